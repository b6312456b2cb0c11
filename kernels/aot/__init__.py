"""Ahead-of-time checks of the kernels, run on machines without a GPU: ``compile_check`` compiles every
kernel for sm_80/sm_90/sm_100 as the host code launches it (registers, spills, tensor cores, repeated warps)
and ``static_perf`` reads the compiled SASS for the attention judge (``benchmarks/attention_judge.py``).

Imports: ``distaff.kernels`` (the ops whose launches it records), torch, triton. Imported by: tests and
benchmarks only; nothing that runs in training imports this package.
"""
