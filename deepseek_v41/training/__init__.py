"""FSDP2 + expert-parallel fine-tuning of DeepSeek-V4.1 (not part of the modeling path).

``recipe`` (YAML + dotted overrides), ``data`` (HellaSwag SFT), ``optim`` (remainder AdamW, schedule,
clipping), ``expert_parallel`` (EP mesh, all-to-all dispatcher), ``engram_owner`` (row-owner Engram tables),
``fsdp`` (units, mixed precision, activation checkpointing), ``model_setup`` / ``sharded_load`` (meta model,
per-rank checkpoint reads), ``loop`` (the run), ``export`` (floating-point export).
Entry point: ``examples/finetune.py``.
"""
