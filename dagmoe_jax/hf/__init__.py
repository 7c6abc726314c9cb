"""Hugging Face checkpoints in and out: :mod:`~dagmoe_jax.hf.llama` reads a Llama-architecture
folder (``config.json``, safetensors, tokenizer) into a dense model of this library, and writes
one back. Fine-tuning starts from one (``TrainConfig.init_from``), DUME upcycles several."""
