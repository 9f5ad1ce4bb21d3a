"""OpenAI-compatible HTTP server: a thin adapter that hands Engine.request()s to a quasar.decoding.batch.Batch
(quasar.serve.scheduler); no generation logic lives here."""
