"""Progress without a terminal: long runs write plain lines (count, rate, time left) instead of a hidden bar."""

from quasar.progress import lines, progress, status


def test_without_a_terminal_progress_passes_every_item_through(capsys):
    assert list(progress(range(5), "work", total=5)) == [0, 1, 2, 3, 4]  # stderr is captured: not a terminal
    assert capsys.readouterr().err == ""  # under 10 s: no line yet


def test_a_line_names_the_work_the_count_of_a_resumed_run_and_the_time_left(capsys):
    assert list(lines(["a", "b", "c"], "gsm8k [w8a8]", total=10, initial=4, every_s=0)) == ["a", "b", "c"]
    out = capsys.readouterr().err.splitlines()
    assert len(out) == 4
    assert out[0].startswith("gsm8k [w8a8]: 5/10 (50%), ")
    assert out[2].startswith("gsm8k [w8a8]: 7/10 (70%), ") and out[2].endswith(" left")
    assert out[3] == "gsm8k [w8a8]: done, 7 in 0 s"  # a phase that wrote lines says where it ended


def test_status_reads_per_second_or_per_minute_and_copes_without_a_total():
    assert status(53, 250, 9.0 / 60) == "53/250 (21%), 9.0/min, about 22 min left"
    assert status(5, 10, 2.0) == "5/10 (50%), 2.00/s, about 2 s left"
    assert status(5, None, 0.5) == "5 done, 30.0/min"


def test_a_polled_call_writes_lines_with_its_count_while_it_blocks(capsys, monkeypatch):
    import time

    from quasar import progress as progress_module

    monkeypatch.setattr(progress_module, "LINE_EVERY_S", 0.0)
    written = iter(range(100))
    with progress_module.polled("compiling", 20, lambda: next(written), unit="files"):
        time.sleep(1.2)  # the poll runs twice a second
    out = capsys.readouterr().err.splitlines()
    assert len(out) > 1 and all(line.startswith("compiling: ") and "/20 (" in line and "files/" in line for line in out[:-1])
    assert out[-1].startswith("compiling: done, ") and out[-1].endswith(" files in 1 s")
