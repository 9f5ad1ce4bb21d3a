"""The one grammar of what a command runs: a verifier name and an engine name, parsed once into values.

    VerifierSpec.parse("w8a8:g64:lmbf16")   # kind w8a8, group 64, alpha unnamed (auto), a bf16 lm_head
    EngineSpec.parse("ngram+w8a8+bf16")     # drafter ngram, levels (w8a8, bf16): w8a8 drafts for bf16
    EngineSpec.parse("ar:w8a8")             # plain decoding (no drafter) with the w8a8 verifier

Verifier names: auto (what fits the model: a quantized GGUF's own blocks, else w8a8), gguf (a GGUF file's own blocks
as they are), fp32, bf16, w8a16, w4a8[:gN][:awq|:rtn|:gptq] (4-bit blocks fitted to the float weights; plain w4a8
names gguf on a GGUF file), pruned:N and w8a8[:pc|:gN][:auto|:none|:ALPHA][:lm8|:lmbf16]. Drafter names: none, ngram,
suffix, model:PATH, layerskip:N. An engine name is
[DRAFTER+]LEVEL[+LEVEL] or ar:LEVEL[+LEVEL]: with two levels the first drafts for the second, whose output the
request gets (the cascade). `str(spec)` writes a spec back in its canonical form, which parses to the same spec.
Every other module takes these values and never splits a name again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FLOAT_KINDS = ("fp32", "bf16")
QUANTIZED_KINDS = ("w8a8", "w8a16")
GGUF = "gguf"  # a GGUF file's own quantized blocks, computed on as they are
AUTO = "auto"
KINDS = (AUTO, GGUF, *FLOAT_KINDS, *QUANTIZED_KINDS, "w4a8", "pruned")
VERIFIER_FORMS = ("auto, gguf, fp32, bf16, w8a8[:pc|:gN][:auto|:none|:ALPHA][:lm8|:lmbf16], w8a16, "
                  "w4a8[:gN][:awq|:rtn|:gptq], pruned:N")
# How calibrated 4-bit blocks are fitted: activation-aware search, min-max rounding, or the activation-aware fit's
# scales with error-compensating (GPTQ-style) rounding of the quants.
FIT_METHODS = ("awq", "rtn", "gptq")
ENGINE_FORMS = "[DRAFTER+]VERIFIER[+VERIFIER] or ar:VERIFIER[+VERIFIER] (e.g. ngram+w8a8, ar:bf16, ngram+w8a8+bf16)"
NO_DRAFTER = "none"
DRAFTERS = {NO_DRAFTER: "", "ngram": "", "suffix": "", "model": "PATH", "layerskip": "N"}  # name -> its argument
DRAFTER_FORMS = "none, ngram, suffix, model:PATH (a .gguf file, a model directory or an installed name), layerskip:N"
PLAIN = "ar"
MAX_WIDTH = 4  # candidates per position of a draft tree at most
MAX_DRAFT = 7  # draft tokens a verify step takes at most: it scores k + 1 rows, and the torch path's fixed shape is 8
LM_HEADS = {"lm8": True, "lmbf16": False}  # a w8a8 name's lm_head part -> the lm_head is W8A8 (else bf16)


@dataclass(frozen=True)
class VerifierSpec:
    """One verifier: the model whose distribution the output follows. Parts a name leaves out are None (the
    defaults apply), so a loader can tell 'w8a8' (any group, any lm_head) from 'w8a8:g32:lm8'."""

    kind: str
    group: int | None = None  # w8a8: scales per group of this many inputs, 0 per channel ('pc'); None: the default
    alpha: float | str | None = None  # w8a8: smoothing strength, 'auto' or 'none'; None: unnamed (auto)
    lm_head: str | None = None  # w8a8: 'lm8' (W8A8 lm_head) or 'lmbf16'; None: unnamed (W8A8)
    layers: int | None = None  # pruned: how many layers to drop
    method: str | None = None  # w4a8: how calibrated blocks are fitted ('awq', 'rtn', 'gptq'); None: unnamed

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown verifier {self.kind!r}; choose from {VERIFIER_FORMS}")
        if self.kind != "w8a8" and (self.alpha, self.lm_head) != (None, None):
            raise ValueError(f"only w8a8 takes an alpha or lm_head part (got {self!s})")
        if self.kind not in ("w8a8", "w4a8") and self.group is not None:
            raise ValueError(f"only w8a8 and w4a8 take a group part (got {self!s})")
        if self.kind != "w4a8" and self.method is not None or self.method not in (None, *FIT_METHODS):
            raise ValueError(f"only w4a8 takes a fitting method, {' or '.join(FIT_METHODS)} (got {self!s})")
        if self.kind == "w4a8" and self.group == 0:
            raise ValueError("w4a8 keeps a scale per group of inputs; pc (per channel) is a w8a8 part")
        if (self.kind == "pruned") != (self.layers is not None):
            raise ValueError("pruned:N names how many layers to drop; no other verifier takes a number"
                             if self.kind == "pruned" else f"{self.kind} takes no argument")
        if self.group is not None and self.group and (self.group < 32 or self.group % 32):
            raise ValueError(f"the group size must be a multiple of 32, not {self.group}")
        if self.lm_head is not None and self.lm_head not in LM_HEADS:
            raise ValueError(f"the lm_head part is lm8 or lmbf16, not {self.lm_head!r}")
        if isinstance(self.alpha, float) and not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], not {self.alpha}")

    @classmethod
    def parse(cls, text: str) -> VerifierSpec:
        kind, *parts = text.split(":")
        if kind not in KINDS:
            raise ValueError(f"unknown verifier {text!r}; choose from {VERIFIER_FORMS}")
        if kind == "pruned":
            if len(parts) != 1 or not parts[0].isdigit() or int(parts[0]) < 1:
                raise ValueError(f"pruned:N names how many layers to drop (N >= 1), got {text!r}")
            return cls(kind, layers=int(parts[0]))
        if kind not in ("w8a8", "w4a8") and parts:
            raise ValueError(f"the {kind} verifier takes no argument (got {text!r}); choose from {VERIFIER_FORMS}")
        fields: dict[str, object] = {}
        for part in parts:
            name, value = part_value(part, text)
            if name in fields:
                raise ValueError(f"verifier {text!r} names its {name} twice")
            fields[name] = value
        return cls(kind, **fields)  # type: ignore[arg-type]

    def __str__(self) -> str:
        if self.kind == "pruned":
            return f"pruned:{self.layers}"
        parts = [self.kind]
        if self.group is not None:
            parts.append(f"g{self.group}" if self.group else "pc")
        if self.alpha is not None:
            parts.append(str(self.alpha))
        if self.lm_head is not None:
            parts.append(self.lm_head)
        if self.method is not None:
            parts.append(self.method)
        return ":".join(parts)

    @property
    def quantized(self) -> bool:
        """Quantized weights, from the float model's (and cached on disk): w8a8 and w8a16."""
        return self.kind in QUANTIZED_KINDS

    @property
    def calibrated_blocks(self) -> bool:
        """w4a8 with a group or method named: 4-bit blocks fitted to the float weights (else a GGUF's own blocks)."""
        return self.kind == "w4a8" and (self.group, self.method) != (None, None)

    @property
    def file_blocks(self) -> bool:
        """gguf, or plain w4a8 (its alias on a GGUF file): the file's own quantized blocks."""
        return self.kind == GGUF or self.kind == "w4a8" and not self.calibrated_blocks

    @property
    def int8_lm_head(self) -> bool:
        """Whether the lm_head is W8A8: w8a8's default, unless the name says lmbf16; w8a16 keeps a bf16 one."""
        return self.kind == "w8a8" and self.lm_head != "lmbf16"


def part_value(part: str, text: str) -> tuple[str, object]:
    """One part of a w8a8 name -> (field, value)."""
    if part in LM_HEADS:
        return "lm_head", part
    if part in FIT_METHODS:
        return "method", part
    if part == "pc":
        return "group", 0
    if part[:1] == "g" and part[1:].isdigit():
        return "group", int(part[1:])
    if part in (AUTO, "none"):
        return "alpha", part
    try:
        return "alpha", float(part)
    except ValueError:
        raise ValueError(f"verifier {text!r}: {part!r} is neither pc, gN, lm8, lmbf16, awq, rtn, gptq, auto, none nor an alpha; "
                         f"choose from {VERIFIER_FORMS}") from None


@dataclass(frozen=True)
class EngineSpec:
    """What an engine runs: a drafter ('none': plain decoding), one verifier or a cascade of two (the first
    drafts for the second), the draft length k (or 'auto'), the confidence guard's margin (None: off) and the
    candidates per position of a draft tree (1: one chain; 'auto': as many as pay)."""

    levels: tuple[VerifierSpec, ...]
    drafter: str = NO_DRAFTER
    k: int | str = AUTO
    guard: float | None = None
    tree: int | str = 1

    def __post_init__(self) -> None:
        check_drafter(self.drafter)
        if len(self.levels) not in (1, 2):
            raise ValueError(f"an engine verifies with one verifier or a cascade MIDDLE+TOP, got {len(self.levels)}")
        if self.guard is not None:
            if not self.guard >= 0:
                raise ValueError(f"the guard margin must be a number >= 0 (logits), got {self.guard}")
            if self.drafter == NO_DRAFTER:
                raise ValueError("--guard re-scores speculative decoding's verify steps: it needs a drafter")
            if self.top.kind != AUTO and (self.middle is not None or not self.top.quantized):
                what = "a cascade" if self.middle is not None else "not one"
                raise ValueError(f"--guard re-scores the unsure positions of a {' or '.join(QUANTIZED_KINDS)} verifier "
                                 f"with bf16; --verifier {self.verifier_name} is {what}")

    @classmethod
    def parse(cls, text: str, k: int | str = AUTO, guard: float | None = None, tree: int | str = 1) -> EngineSpec:
        """'ngram+w8a8', 'ar:bf16', 'w8a8+bf16' (no drafter), 'model:PATH+w8a8' (a path may hold '+')."""
        if text.startswith(PLAIN + ":"):
            return cls(parse_levels(text[len(PLAIN) + 1 :]), NO_DRAFTER, k, guard, tree)
        parts = text.split("+")
        levels = [VerifierSpec.parse(parts.pop())]
        if parts and is_verifier(parts[-1]):
            levels.insert(0, VerifierSpec.parse(parts.pop()))
        drafter = "+".join(parts) or NO_DRAFTER
        if not all(parts) or drafter == PLAIN:
            raise ValueError(f"cannot read {text!r} as an engine; use {ENGINE_FORMS}")
        return cls(tuple(levels), drafter, k, guard, tree)

    def __str__(self) -> str:
        return (f"{PLAIN}:" if self.drafter == NO_DRAFTER else f"{self.drafter}+") + self.verifier_name

    @property
    def top(self) -> VerifierSpec:
        """The verifier whose output the request gets."""
        return self.levels[-1]

    @property
    def middle(self) -> VerifierSpec | None:
        """A cascade's middle level (its output drafts for the top), or None."""
        return self.levels[0] if len(self.levels) == 2 else None

    @property
    def verifier_name(self) -> str:
        return "+".join(map(str, self.levels))

    @property
    def speculative(self) -> bool:
        return self.drafter != NO_DRAFTER or self.middle is not None

    def exact(self) -> EngineSpec:
        """--exact: the quantized verifier drafts for bf16, whose output the request gets."""
        if self.middle is not None or self.top.kind in FLOAT_KINDS:  # 'auto' is never float
            raise ValueError(f"--exact makes the quantized verifier draft for bf16; --verifier {self.verifier_name} "
                             "is already float or a cascade")
        return replace(self, levels=(self.top, VerifierSpec("bf16")))


def parse_levels(text: str) -> tuple[VerifierSpec, ...]:
    """'w8a8' or a cascade 'w8a8+bf16' -> its levels."""
    levels = text.split("+")
    if len(levels) > 2 or not all(levels):
        raise ValueError(f"a cascade verifier is MIDDLE+TOP, e.g. 'w8a8+bf16', got {text!r}")
    return tuple(VerifierSpec.parse(level) for level in levels)


def check_drafter(text: str) -> None:
    """Refuse a drafter name that is not one of DRAFTER_FORMS (its argument, a path or a layer count, is checked
    when the drafter is built: a path against the file system, N against the model's layers)."""
    name, colon, arg = text.partition(":")
    if name not in DRAFTERS:
        raise ValueError(f"unknown drafter {text!r}; choose from {DRAFTER_FORMS}")
    wants = DRAFTERS[name]
    if wants and not arg:
        raise ValueError(f"the {name} drafter needs an argument: '{name}:{wants}' (got {text!r})")
    if not wants and colon:
        raise ValueError(f"the {name} drafter takes no argument (got {text!r})")
    if wants == "N" and not (arg.isdigit() and int(arg) >= 1):
        raise ValueError(f"layerskip:N keeps the first N layers (N >= 1), got {text!r}")


def is_verifier(text: str) -> bool:
    return text.partition(":")[0] in KINDS


def parse_tree(text: str | int) -> int | str:
    """'auto' or an integer 1 <= width <= MAX_WIDTH: the candidates a draft tree tries at each position."""
    if text == AUTO:
        return AUTO
    if not str(text).isdigit() or not 1 <= int(text) <= MAX_WIDTH:
        raise ValueError(f"--tree must be 'auto' or a width from 1 (one chain) to {MAX_WIDTH}, got {text!r}")
    return int(text)


def parse_k(text: str | int, k_max: int = MAX_DRAFT) -> int | str:
    """'auto' or an integer 1 <= k <= k_max (a verify step scores k + 1 tokens)."""
    if text == AUTO:
        return AUTO
    if not str(text).isdigit() or int(text) < 1:
        raise ValueError(f"--k must be a positive integer or 'auto', got {text!r}")
    if int(text) > k_max:
        raise ValueError(f"--k {text} is too long: a verify step scores k + 1 tokens and the exact verify path "
                         f"takes at most {k_max + 1}; use --k {k_max} or less, or 'auto'")
    return int(text)
