"""Hugging Face integrations (optional extra ``transformers``): ``shardopt.integrations.transformers.enable``
for ``Trainer`` and ``shardopt.integrations.accelerate.prepare`` for ``accelerate``; both map DeepSpeed ZeRO's
flat partitions and FSDP2's DTensors to matrices and keep checkpoints resumable at any world size."""
