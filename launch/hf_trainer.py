"""    .venv/bin/python launch/hf_trainer.py --ds-config ds_configs/gift_fp8_zero2.json --steps 20
    DEEPSPEED_GIFT=1 .venv/bin/python launch/hf_trainer.py --switch env --framework accelerate

GIFT under the HF Trainer, from the config alone: ``deepspeed_gift.install()`` before the
Trainer builds its engine (or ``DEEPSPEED_GIFT=1`` and no code at all), then an ordinary
``Trainer`` with ``TrainingArguments(deepspeed=...)``. The shipped ds_config is used as is,
except that the keys the Trainer owns (batch size, optimizer lr, gradient clipping) become
"auto", as Trainer recipes write them. Runs ``--ranks`` CPU ranks over gloo on the tiny or
small Llama and byte tokens of the standard library's sources; prints the losses and GIFT's
telemetry. ``--framework accelerate`` runs the same through Accelerate's DeepSpeed plugin and a
plain loop instead of the Trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TRAINER_KEYS = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto"}


def trainer_config(path: str) -> dict:
    """The shipped config with the Trainer's own keys as "auto" (the gift block untouched)."""
    with open(os.path.join(ROOT, path) if not os.path.isabs(path) else path) as f:
        cfg = json.load(f)
    cfg.update(TRAINER_KEYS)
    if "optimizer" in cfg:
        cfg["optimizer"]["params"].update(lr="auto", weight_decay="auto", betas="auto", eps="auto")
    cfg.pop("scheduler", None)
    return cfg


def run_config(opts: dict) -> dict:
    """:func:`trainer_config` of ``opts["ds_config"]`` with the run's variations: ``gift`` replaces
    the block, ``native`` drops it (DeepSpeed's own reduction), ``fp32`` drops bf16 (then a
    lossless block must match the native run exactly)."""
    cfg = trainer_config(opts["ds_config"])
    if opts.get("gift") is not None:
        cfg["gift"] = opts["gift"]
    if opts.get("native"):
        cfg.pop("gift", None)
    if opts.get("fp32"):
        cfg.pop("bf16", None)
    return cfg


class ByteText:
    """Fixed-length windows of byte tokens, a dataset the Trainer can index."""

    def __init__(self, seq: int, n: int, seed: int):
        import torch

        from launch.data import corpus_bytes

        data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        gen = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, data.numel() - seq - 1, (n,), generator=gen).tolist()
        self.items = [data[s:s + seq] for s in starts]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return {"input_ids": self.items[i], "labels": self.items[i]}


def _StopAt(step: int):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True
            return control

    return StopAt()


def run_rank(rank: int, world: int, opts: dict) -> dict:
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    import deepspeed_gift
    from launch.pretrain import PRESETS

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no C++ build on CPU
    os.environ.setdefault("LOCAL_RANK", str(rank))
    if opts.get("switch", "install") == "install":
        deepspeed_gift.install()
    torch.manual_seed(opts.get("seed", 0))
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[opts.get("preset", "tiny")]))
    cfg = run_config(opts)
    args = TrainingArguments(
        output_dir=opts["out"], deepspeed=cfg, per_device_train_batch_size=opts.get("micro", 2),
        max_steps=opts.get("steps", 4), learning_rate=opts.get("lr", 2e-3), weight_decay=0.0, max_grad_norm=1.0,
        lr_scheduler_type="constant", logging_steps=1, save_steps=opts.get("save_steps") or 10**9,
        save_strategy="steps" if opts.get("save_steps") else "no", report_to=[], use_cpu=True,
        bf16="bf16" in cfg and cfg["bf16"].get("enabled", False), seed=opts.get("seed", 0),
        dataloader_drop_last=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=ByteText(opts.get("seq", 32), 256, opts.get("seed", 0)))
    if opts.get("stop_at"):  # an interrupted run: the same schedule as the full one, stopped after a save
        trainer.add_callback(_StopAt(opts["stop_at"]))
    trainer.train(resume_from_checkpoint=opts.get("resume"))
    engine = trainer.model_wrapped
    gift = getattr(engine, "gift", None)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"losses": losses, "attached": gift is not None, "global_step": trainer.state.global_step,
            "records": list(gift.records) if gift is not None else [],
            "version": gift.geometry.version if gift is not None else None,
            "whitener_digest": {f"{k}:{n}": [t.double().sum().item() for t in w.to_tensors()]
                                for k, maps in sorted(gift.geometry.transforms.items())
                                for n, w in sorted(maps.items())} if gift is not None else {}}


def run_accelerate_rank(rank: int, world: int, opts: dict) -> dict:
    """The same model, data and config through Accelerate's DeepSpeed plugin and a plain loop
    (what ``accelerate launch --use_deepspeed --deepspeed_config_file ...`` sets up)."""
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DummyOptim
    from transformers import LlamaConfig, LlamaForCausalLM

    import deepspeed_gift
    from launch.pretrain import PRESETS

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # what accelerate launch --use_deepspeed sets
    if opts.get("switch", "install") == "install":
        deepspeed_gift.install()
    torch.manual_seed(opts.get("seed", 0))
    model = LlamaForCausalLM(LlamaConfig(**PRESETS[opts.get("preset", "tiny")]))
    cfg = run_config(opts)
    cfg["gradient_clipping"] = 1.0
    cfg["optimizer"]["params"].update(lr=opts.get("lr", 2e-3), weight_decay=0.0, betas=[0.9, 0.95], eps=1e-8)
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # one process may run several configs (tests): a fresh plugin each
    plugin = DeepSpeedPlugin(hf_ds_config=cfg)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16" if "bf16" in cfg else "no")
    loader = torch.utils.data.DataLoader(ByteText(opts.get("seq", 32), 256, opts.get("seed", 0)),
                                         batch_size=opts.get("micro", 2), shuffle=False)
    engine, _, loader = accelerator.prepare(model, DummyOptim(model.parameters()), loader)
    done = 0
    if opts.get("resume"):  # Accelerate's own checkpoint: the engine's load_checkpoint, GIFT's files with it
        accelerator.load_state(opts["resume"])
        done = engine.global_steps
    losses = []
    for i, batch in enumerate(loader):
        if i == opts.get("steps", 4):
            break
        if i < done:
            continue
        loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)  # under DeepSpeed this also runs engine.step()
        losses.append(float(loss.detach()))
        if opts.get("save_at") == i + 1:
            accelerator.save_state(opts["out"])
    gift = getattr(engine, "gift", None)
    return {"losses": losses, "attached": gift is not None, "records": list(gift.records) if gift else [],
            "version": gift.geometry.version if gift is not None else None}


def main(argv=None) -> int:
    from launch.spawn import run_ranks

    p = argparse.ArgumentParser(description="GIFT under the HF Trainer or Accelerate, switched on from the config alone")
    p.add_argument("--ds-config", default="ds_configs/gift_fp8_zero2.json")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--preset", default="tiny")
    p.add_argument("--out", default="runs/hf_trainer")
    p.add_argument("--switch", choices=("install", "env"), default="install",
                   help="install: deepspeed_gift.install() in the script; env: nothing in the script, "
                        "DEEPSPEED_GIFT=1 in the environment does it")
    p.add_argument("--framework", choices=("trainer", "accelerate"), default="trainer")
    a = p.parse_args(argv)
    body = run_rank if a.framework == "trainer" else run_accelerate_rank
    results = run_ranks(body, a.ranks, {"ds_config": a.ds_config, "steps": a.steps, "preset": a.preset,
                                        "out": a.out, "switch": a.switch})
    r = results[0]
    print(f"GIFT attached: {r['attached']}; losses {', '.join(f'{x:.3f}' for x in r['losses'])}")
    if r["records"]:
        last = r["records"][-1]
        print(f"bytes per element {last['bytes_per_elem']:.3f} (bf16 = 2), fidelity {last.get('fidelity_rel_err')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
