"""Hugging Face checkpoints in and out: :mod:`~dagmoe_jax.hf.llama` reads a Llama-architecture
folder (``config.json``, safetensors, tokenizer) into a dense model of this library, and writes
one back; :mod:`~dagmoe_jax.hf.moe` reads Mixtral, OLMoE and Qwen3-MoE folders into the MoE
block through the same reader; :mod:`~dagmoe_jax.hf.run` reads a folder as a run
(``hf:FOLDER``). Fine-tuning starts from one (``RunConfig.init_from``), DUME upcycles
several."""
