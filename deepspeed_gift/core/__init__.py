"""The pure core: wire formats (``formats``), geometry and its transforms (``geometry``) and the
optimizers' update rules GIFT judges layers by (``metrics``). Torch only: no
``torch.distributed``, no DeepSpeed."""
