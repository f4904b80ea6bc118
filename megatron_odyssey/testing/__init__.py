"""Test and benchmark harnesses, not part of a training job: the fault-free single-process reference
trainer and helpers that run Megatron-LM's ``pretrain_gpt.py`` as a user would and read its logs."""
