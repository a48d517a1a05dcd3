"""GPU benchmarks of the kernels of kernels/ (run as `python -m benchmarks.bench_mamba2`, `python -m
benchmarks.bench_gdn`); their numbers and commands are in docs/kernel_performance.md."""
