"""Benchmarks behind `specache bench`: needle (pass-key retrieval grid), fidelity (agreement with
the full cache and selection quality of the guide) and speed (prefill/decode timing and peak
RSS per mode). Each bench is a generator that yields common.BenchProgress events and ends with a
common.BenchResult holding the JSON-ready result; report.py renders the Markdown reports.

Submodules are not imported here: speed.py also runs as `python -m engine.bench.speed`."""
