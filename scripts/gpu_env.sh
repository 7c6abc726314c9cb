# Environment for GPU runs (source it): XLA flags that matter for this model on A100 / H100.
#  - latency-hiding scheduler: overlaps the expert all-to-alls and FSDP all-gathers with compute
#    (NVIDIA JAX-Toolbox sets it by default);
#  - cuDNN ragged-dot fusion: dropless dispatch's grouped matmuls (jax.lax.ragged_dot,
#    ModelConfig.grouped_matmul='ragged_dot', the GPU default) run as cuDNN grouped GEMMs instead
#    of XLA's rewrite into a dense dot over zero-padded groups (openxla/xla#40189 reports >20x);
#    it needs cuDNN >= 9.22 on sm80 or newer, and XLA falls back to the dense rewrite where a
#    ragged dot is not supported (the weight gradient); newer XLA turns it on by default
#    (openxla/xla#42313), this keeps it on for the pinned version;
#  - 90% of GPU memory preallocated for XLA, the rest for cuDNN / NCCL workspaces.
export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_latency_hiding_scheduler=true --xla_gpu_experimental_use_ragged_dot_fusion=true"
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
