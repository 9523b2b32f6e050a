"""tile_pass with training stacks: Hugging Face Trainer / accelerate, TRL, PEFT, Lightning, DeepSpeed.

* :mod:`tile_pass.integrations.transformers`: :func:`compile_for_training` (the one-line
  setup for any ``nn.Module``, made for ``transformers.Trainer``), :func:`report` (what the
  pass did, with hints about the stack), :class:`TilePassCallback` (compiles at trainer
  construction and logs the report after the first step).
* :mod:`tile_pass.integrations.trl`: detects TRL's own chunked LM head
  (``trl.trainer.utils.add_fused_lm_head``), which hides the head from tile_pass, and gives
  an ``SFTTrainer``'s head back to the model (and so to tile_pass).
* :mod:`tile_pass.integrations.deepspeed`: :func:`compile_engine` (the one line for a DeepSpeed
  engine at any ZeRO stage, Ulysses sequence parallelism included) and
  :func:`hand_head_to_tile_pass` (ZeRO-3: the LM head and the loss in one graph, the head weight
  still gathered and released by ZeRO).

Nothing here is imported by ``import tile_pass``; each submodule imports its library itself.
See docs/stacks.md.
"""
