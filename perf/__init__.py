"""Benchmark harness (issue 5): S-LoRA's workloads against the engine, the Triton server and HF PEFT.

Every module runs from the repository root as `python -m perf.<module> --help`. See perf/RESULTS.md.
"""
