# Environment for GPU runs (source it): XLA flags that matter for this model on A100 / H100.
#  - latency-hiding scheduler: overlaps the expert all-to-alls and FSDP all-gathers with compute
#    (NVIDIA JAX-Toolbox sets it by default);
#  - 90% of GPU memory preallocated for XLA, the rest for cuDNN / NCCL workspaces.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
