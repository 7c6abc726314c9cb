# Environment for GPU runs (source it): XLA flags that matter for this model on A100 / H100.
#  - latency-hiding scheduler: overlaps the expert all-to-alls and FSDP all-gathers with compute
#    (NVIDIA JAX-Toolbox sets it by default);
#  - cuDNN ragged-dot fusion: only for a run that binds ExecutionConfig.grouped_matmul=
#    'ragged_dot' ('auto' settles to the library's GPU kernels, 'mgpu' on Hopper and 'triton'
#    on sm80+, which need no flag). With it XLA runs jax.lax.ragged_dot as cuDNN grouped GEMMs
#    instead of its rewrite into a dense dot over zero-padded groups, where cuDNN takes them:
#    cuDNN >= 9.22 for the forward and input gradient, >= 9.24 with jaxlib >= 0.12 for the
#    weight gradient; elsewhere XLA falls back to the dense rewrite. The flag is off by default
#    in jaxlib 0.11.2 and 0.12.0.1; keep it off when compiling for a GPU on a host without one
#    (a cuDNN fusion aborts that compile);
#  - 90% of GPU memory preallocated for XLA, the rest for cuDNN / NCCL workspaces.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_use_ragged_dot_fusion=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
