r"""    .venv/bin/torchrun --nproc_per_node 2 launch/pretrain.py --ds-config ds_configs/gift_fp8_zero2.json --preset tiny --steps 50

Pretrains a Llama (HF ``LlamaForCausalLM``) with DeepSpeed ZeRO-1/2, and GIFT when the
config has a ``gift`` block (the line above: 2 CPU ranks, a minute).

Other launchers run the same script (see ``launch/run_deepspeed.sh``, ``launch/run_mpirun.sh``):

    .venv/bin/deepspeed --hostfile launch/hostfile.example --no_ssh --node_rank 0 --master_addr 127.0.0.1 \
        launch/pretrain.py --ds-config ds_configs/gift_fp8_zero2.json --preset tiny --steps 50
    .venv/bin/mpirun -np 2 .venv/bin/python launch/pretrain.py --ds-config ds_configs/gift_fp8_mpi_zero2.json \
        --preset tiny --steps 50    # as root in a container: mpirun --allow-run-as-root

Model: ``--preset`` tiny (CPU, seconds) | small | 300m | 600m (32 layers, hidden 1280,
FFN 3456, sequence 2048), or ``--model-config`` (a HF config json or directory).
Data: the embedded standard-library corpus, or ``--data`` (see ``launch/data.py``).
Batch and learning rate: ``--micro-batch``, ``--grad-accum``, ``--lr`` and ``--muon-lr``
override the config's ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
``optimizer.params.lr`` and (Muon configs) ``optimizer.params.muon_lr``; the config's
``train_batch_size`` is dropped (DeepSpeed derives it). Without a ``scheduler`` in the
config, the learning rate warms up linearly for ``--warmup`` steps and decays by a cosine to
``--min-lr-ratio`` at ``--steps``.

Compute dtype: ``--compute-dtype auto`` (the default) trains in the config's dtype, except a
bf16 config on a CPU without a fast bf16 matmul (AVX2-only x86: PyTorch's bf16 GEMM is then a
scalar loop, ~50x slower than fp32), which computes in fp32 and keeps bf16 gradients on the
wire; the log says so in one line and the metrics' start record keeps it (``compute_dtype``).
On a GPU nothing changes. ``--compute-dtype bf16`` or ``fp32`` chooses (``launch/compute.py``).

Logs (rank 0): train loss, learning rate, step time, tokens/s, GIFT wire bytes per
gradient element and sampled fidelity; validation loss and next-token accuracy every
``--eval-every`` steps. ``--metrics run.jsonl`` keeps them (read by ``launch/compare.py``).
Checkpoints: ``--save-dir DIR --save-every N`` (GIFT's state is saved beside DeepSpeed's);
``--resume`` continues from DIR's latest checkpoint (``--resume OTHER_DIR``, or one tag:
``--resume DIR/step300``). Batches depend only on (seed, step, rank), so a resumed run
sees the same data, and repeats the losses, of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from launch import data as gift_data  # noqa: E402
from launch.compute import COMPUTE_DTYPES, agreed_compute_dtype, bf16_path, with_compute_dtype  # noqa: E402

PRESETS = {
    # CPU-sized: tests and smoke runs
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128),
    "small": dict(vocab_size=256, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=256),
    # the paper's family: ~300M and ~600M parameters without embeddings
    "300m": dict(hidden_size=1024, intermediate_size=2752, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=16, max_position_embeddings=2048),
    "600m": dict(hidden_size=1280, intermediate_size=3456, num_hidden_layers=32, num_attention_heads=20,
                 num_key_value_heads=20, max_position_embeddings=2048),
}
DEFAULT_SEQ = {"tiny": 128, "small": 256, "300m": 2048, "600m": 2048}
DEFAULT_MICRO_BATCH = 4
DEFAULT_CONFIG = os.path.join("ds_configs", "gift_fp8_zero2.json")
DESCRIPTION = "Pretrain a Llama with DeepSpeed ZeRO-1/2 and GIFT (see the module docstring for launch lines)."


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=DESCRIPTION,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ds-config", default=DEFAULT_CONFIG, help="DeepSpeed config json (with or without a gift block)")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--model-config", help="HF LlamaConfig json file or directory (overrides --preset)")
    p.add_argument("--data", nargs="+", help="text/JSONL files or dirs, or a datasets.save_to_disk dir "
                                             "(default: embedded standard-library corpus)")
    p.add_argument("--text-field", default="text", help="JSONL / dataset field holding the text")
    p.add_argument("--tokenizer", help="local HF tokenizer directory (default: bytes, vocabulary 256)")
    p.add_argument("--val-fraction", type=float, default=gift_data.DEFAULT_VAL_FRACTION)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (total, including resumed ones)")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--micro-batch", type=int, help=f"sequences per rank per micro step (default: config's, "
                                                   f"else {DEFAULT_MICRO_BATCH})")
    p.add_argument("--grad-accum", type=int, help="micro steps per optimizer step (default: config's, else 1)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: preset's: tiny 128, small 256, "
                                               "300m/600m 2048)")
    p.add_argument("--lr", type=float, help="peak learning rate (default: config's optimizer.params.lr; with Muon "
                                            "that is the lr of the parameters Muon leaves to Adam when the config "
                                            "sets muon_lr)")
    p.add_argument("--muon-lr", type=float, help="peak learning rate of Muon's matrices (Muon configs only; "
                                                 "default: config's optimizer.params.muon_lr)")
    p.add_argument("--warmup", type=int, help="linear warmup steps (default: min(100, steps // 10))")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine floor as a fraction of --lr")
    p.add_argument("--eval-every", type=int, default=50, help="validation every N steps (0: only at the end)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation micro batches per rank")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--metrics", help="per-run JSONL metrics file (rank 0)")
    p.add_argument("--save-dir", help="DeepSpeed checkpoint directory")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only at the end)")
    p.add_argument("--resume", nargs="?", const="", default=None,
                   help="resume from the latest checkpoint in --save-dir (none yet: start fresh), or from the "
                        "given checkpoint directory (its latest) or tag directory (DIR/step300)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="auto",
                   help="dtype of the forward and backward. auto: the config's, except a bf16 config on a CPU "
                        "without a fast bf16 matmul (no oneDNN bf16 kernel, e.g. AVX2-only x86), which computes "
                        "in fp32 and keeps bf16 on the wire (see launch/compute.py)")
    p.add_argument("--dist-backend", choices=["auto", "gloo", "nccl"], default="auto",
                   help="torch.distributed backend (auto: nccl on GPU, gloo on CPU)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    p.add_argument("--verbose", action="store_true", help="keep DeepSpeed's INFO logs")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    args = p.parse_args(argv)
    for name in ("steps", "micro_batch", "grad_accum", "seq_len", "eval_batches", "log_every"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: got {value}; must be >= 1")
    return args


# ---- configuration ----------------------------------------------------------------------
def resolve_path(path: str) -> str:
    """A path as given, else relative to the repository (so configs work from any cwd)."""
    if os.path.exists(path) or os.path.isabs(path):
        return path
    alt = os.path.join(ROOT, path)
    return alt if os.path.exists(alt) else path


def load_ds_config(args) -> dict:
    path = resolve_path(args.ds_config)
    if not os.path.exists(path):
        raise SystemExit(f"--ds-config: {args.ds_config!r} not found (configs are in ds_configs/)")
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("train_batch_size", None)  # derived from micro batch x accumulation x world size
    cfg["train_micro_batch_size_per_gpu"] = args.micro_batch or cfg.get("train_micro_batch_size_per_gpu",
                                                                        DEFAULT_MICRO_BATCH)
    cfg["gradient_accumulation_steps"] = args.grad_accum or cfg.get("gradient_accumulation_steps", 1)
    if args.lr is not None:
        cfg.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})["lr"] = args.lr
    if args.muon_lr is not None:
        if not is_muon(cfg):
            raise SystemExit(f"--muon-lr: {args.ds_config} uses optimizer "
                             f"{cfg.get('optimizer', {}).get('type')!r}; --muon-lr needs \"type\": \"Muon\"")
        cfg["optimizer"].setdefault("params", {})["muon_lr"] = args.muon_lr
    return cfg


def is_muon(ds_config: dict) -> bool:
    return str(ds_config.get("optimizer", {}).get("type", "")).lower() == "muon"


def run_muon_update_eagerly() -> None:
    """DeepSpeed ``torch.compile``s Muon's update; on CPU inductor builds it with the system C++
    compiler. Measured on the small preset (2 ranks): compiled 0.230 s CPU per step, eager 0.245,
    but every run pays ~6 s of tracing (and ~15 s of C++ build the first time on a machine), so
    eager is as fast over a 250-step run and needs no compiler."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def model_config(args, vocab_size: int):
    from transformers import LlamaConfig

    if args.model_config:
        path = resolve_path(args.model_config)
        config = (LlamaConfig.from_pretrained(path) if os.path.isdir(path) else LlamaConfig.from_json_file(path))
        if config.vocab_size < vocab_size:
            raise SystemExit(f"--model-config: vocab_size {config.vocab_size} is smaller than the tokenizer's "
                             f"{vocab_size}")
    else:
        config = LlamaConfig(**{**PRESETS[args.preset], "vocab_size": vocab_size})
    seq = args.seq_len or DEFAULT_SEQ.get(args.preset if not args.model_config else "", 0) \
        or min(config.max_position_embeddings, 2048)
    config.max_position_embeddings = max(config.max_position_embeddings, seq)
    return config, seq


def checkpoint_location(path: str):
    """``(directory, tag)`` for ``--resume``: a checkpoint directory (DeepSpeed reads its
    ``latest``), or one tag directory inside it (``ckpt/step300``)."""
    if (os.path.isdir(path) and not os.path.exists(os.path.join(path, "latest"))
            and any(f.endswith("model_states.pt") for f in os.listdir(path))):
        return os.path.dirname(os.path.abspath(path)), os.path.basename(os.path.normpath(path))
    return path, None


def lr_lambda(steps: int, warmup: int, min_ratio: float):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


# ---- distributed set-up -----------------------------------------------------------------
def init_distributed(backend: str) -> None:
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cpu":
        # DeepSpeed compiles a shared-memory all-reduce op for CPU at init (~100 s of C++);
        # gloo does the work here, so skip it.
        import deepspeed.comm.torch  # noqa: F401

        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend)


def all_mean(values, device):
    """Mean over ranks of a few floats (one all-reduce)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64 if device.type == "cpu" else torch.float32, device=device)
    dist.all_reduce(t)
    return (t / dist.get_world_size()).tolist()


def evaluate(engine, batches, device) -> dict:
    """Validation loss and next-token accuracy, summed over every token of every rank."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    engine.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    correct = torch.zeros((), dtype=torch.float64)
    count = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for x in batches:
            x = x.to(device)
            logits = engine(input_ids=x).logits[:, :-1].float()
            target = x[:, 1:]
            loss_sum += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                        reduction="sum").double().cpu()
            correct += (logits.argmax(-1) == target).sum().double().cpu()
            count += target.numel()
    engine.train()
    totals = torch.stack([loss_sum, correct, count]).to(device)
    dist.all_reduce(totals)
    loss, hits, n = totals.tolist()
    return {"val_loss": loss / n, "val_acc": hits / n}


# Written by GIFT on refresh steps where the layer selection is profiled: mean relative errors
# over the judged layers of the coordinates in use (and, ``_euclid``, of all-Euclidean ones) in
# plain L2, in the whitened norm and in the configured optimizer's update; layers selected and
# judged; which update rule was measured. Any of them may be absent (older GIFT).
PROFILE_ERRORS = tuple(f"profile_{m}{side}" for side in ("", "_euclid") for m in ("l2", "whitened", "update"))
PROFILE_KEYS = (*PROFILE_ERRORS, "profile_layers", "profile_judged", "update_metric")


def gift_step_telemetry(engine, step_index: int) -> dict:
    """The GIFT record of optimizer step ``step_index`` (0-based), or the native wire size."""
    gift = getattr(engine, "gift", None)
    rec = None if gift is None else next((r for r in reversed(gift.records) if r["step"] == step_index), None)
    if rec is None:  # no GIFT, or before gift.start_step: DeepSpeed's own reduce-scatter and all-gather
        grads = float(engine.communication_data_type.itemsize)
        params = float(next(engine.module.parameters()).element_size())
        return {"bytes_per_elem": grads, "params_bytes_per_elem": params, "bytes_per_elem_total": grads + params,
                "wire": "native"}
    out = {k: rec[k] for k in ("bytes_per_elem", "bytes_per_elem_run", "fidelity_rel_err", "geometry_layers",
                               "geometry_version", "underflow_rate", "saturated", "comm_s", "codec_s",
                               "transform_s", "geometry_s", "hierarchy", "bytes_node", "node_s", "bytes_internode",
                               "params_bytes_per_elem", "bytes_per_elem_total", "params_gap_rel", "params_s",
                               "params_bytes_internode", "params_exact", *PROFILE_KEYS)
           if rec.get(k) is not None}
    out["wire"] = "gift"
    return out


class Progress:
    """A tqdm bar on rank 0 when tqdm is installed (and wanted), plain lines otherwise."""

    def __init__(self, enabled: bool, total: int, initial: int, bar: bool) -> None:
        self.enabled, self.bar = enabled, None
        if enabled and bar:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, postfix: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(postfix, refresh=False)
            self.bar.update(1)

    def log(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Metrics:
    """Rank 0's JSONL file: a ``start`` record per (re)start, ``train`` per step, ``eval``,
    ``end``. Appends when resuming, so the curve of an interrupted run stays in one file."""

    def __init__(self, path, enabled: bool, append: bool) -> None:
        self.f = None
        if path and enabled:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self.f = open(path, "a" if append else "w", buffering=1)

    def write(self, record: dict) -> None:
        if self.f is not None:
            self.f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()


def read_metrics(path: str) -> dict:
    """Merge a metrics file: per-step train and eval records (a step run again after a resume
    keeps its latest record), every start record, the last start and the end of the last start."""
    out = {"start": None, "starts": [], "end": None, "train": {}, "eval": {}}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.get("event")
            if kind == "start":
                out["start"], out["end"] = rec, None
                out["starts"].append(rec)
            elif kind == "end":
                out["end"] = rec
            elif kind in ("train", "eval"):
                out[kind][rec["step"]] = rec
    out["train"] = [out["train"][k] for k in sorted(out["train"])]
    out["eval"] = [out["eval"][k] for k in sorted(out["eval"])]
    return out


def finite(x) -> bool:
    return x is not None and math.isfinite(x)


def summarize(train_records: list, eval_records: list, tail: int = 10, skip: int = 5) -> dict:
    """Final numbers of a run: train loss averaged over the last ``tail`` steps, the last
    validation, median step time (wall clock, and rank 0's CPU time: less sensitive to other
    work on the machine) after ``skip`` warm-up steps, wire bytes of the run."""
    losses = [r["loss"] for r in train_records]
    last = train_records[-tail:]
    times = [r["step_time_s"] for r in train_records[skip:]] or [r["step_time_s"] for r in train_records]
    cpu = [r["cpu_time_s"] for r in train_records[skip:] if "cpu_time_s" in r]
    # GIFT's geometry work (statistics, refits, judgement) as a share of the steps' wall time
    geometry = [(r["geometry_s"], r["step_time_s"]) for r in train_records[skip:] if "geometry_s" in r]
    fid = [r["fidelity_rel_err"] for r in train_records if "fidelity_rel_err" in r]
    out = {
        "steps": train_records[-1]["step"] if train_records else 0,
        "final_train_loss": statistics.fmean(r["loss"] for r in last) if last else None,
        "first_train_loss": losses[0] if losses else None,
        "median_step_s": statistics.median(times) if times else None,
        "median_cpu_s": statistics.median(cpu) if cpu else None,
        "tokens_per_s": statistics.median([r["tokens_per_s"] for r in train_records[skip:]] or
                                          [r["tokens_per_s"] for r in train_records]) if train_records else None,
        "bytes_per_elem": None,
        "fidelity_rel_err": statistics.fmean(fid) if fid else None,
        "geometry_layers": train_records[-1].get("geometry_layers") if train_records else None,
    }
    if train_records:
        last_rec = train_records[-1]
        out["bytes_per_elem"] = last_rec.get("bytes_per_elem_run", last_rec.get("bytes_per_elem"))
        totals = [r["bytes_per_elem_total"] for r in train_records if "bytes_per_elem_total" in r]
        out["bytes_per_elem_total"] = statistics.fmean(totals) if totals else None
        gaps = [r["params_gap_rel"] for r in train_records if "params_gap_rel" in r]
        out["params_gap_rel_max"] = max(gaps) if gaps else None
    if geometry:
        out["geometry_share"] = sum(g for g, _ in geometry) / sum(t for _, t in geometry)
    out.update(summarize_profile(train_records))
    if eval_records:
        out["final_val_loss"] = eval_records[-1]["val_loss"]
        out["final_val_acc"] = eval_records[-1]["val_acc"]
        out["eval_step"] = eval_records[-1]["step"]
    return out


def summarize_profile(train_records: list) -> dict:
    """Means over the refreshes that carried a selection profile, the last layer count and
    update rule; nothing for runs written before GIFT recorded profiles."""
    profiled = [r for r in train_records if any(r.get(k) is not None for k in PROFILE_KEYS)]
    if not profiled:
        return {}
    # a refresh is one geometry version, whether GIFT wrote its profile once or on every step after
    out = {"profile_refreshes": len({r.get("geometry_version", r["step"]) for r in profiled})}
    for key in PROFILE_ERRORS:
        values = [r[key] for r in profiled if finite(r.get(key))]
        if values:
            out[key] = statistics.fmean(values)
    for key in ("profile_layers", "profile_judged", "update_metric"):
        last = next((r[key] for r in reversed(profiled) if r.get(key) is not None), None)
        if last is not None:
            out[key] = last
    return out


# ---- the run ----------------------------------------------------------------------------
def main(argv=None, probe=None) -> dict:
    """Train; returns rank 0's summary (other ranks: their own view). For launchers and tests.
    ``probe(engine, step)``, if given, runs on every rank after each optimizer step (1-based
    ``step``); the dict it returns joins that step's train record (studies measure the
    optimizer's state or GIFT's internals this way, on the very run the losses come from)."""
    args = parse_args(argv)
    import torch
    import torch.distributed as dist

    if not args.verbose:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    import deepspeed_gift

    init_distributed(args.dist_backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    ds_config = load_ds_config(args)
    compute_dtype, compute_note = agreed_compute_dtype(args.compute_dtype, ds_config)
    ds_config = with_compute_dtype(ds_config, compute_dtype)
    if is_muon(ds_config) and not torch.cuda.is_available():
        run_muon_update_eagerly()
    gift_cfg = deepspeed_gift.get_gift_config(ds_config)  # a bad gift block fails here, on every rank
    corpus = gift_data.build_corpus(args.data, args.tokenizer, val_fraction=args.val_fraction,
                                    text_field=args.text_field)
    config, seq = model_config(args, corpus.vocab_size)

    from transformers import LlamaForCausalLM

    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    scheduler_fn = None
    if "scheduler" not in ds_config:
        warmup = args.warmup if args.warmup is not None else min(100, args.steps // 10)

        def scheduler_fn(optimizer):
            return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.steps, max(warmup, 1),
                                                                          args.min_lr_ratio))

    engine, _, _, _ = deepspeed_gift.initialize(model=model, model_parameters=model.parameters(),
                                                config=ds_config, lr_scheduler=scheduler_fn)
    device = torch.device(engine.device)
    micro = engine.train_micro_batch_size_per_gpu()
    ga = engine.gradient_accumulation_steps()

    resumed_from = 0
    if args.resume is not None:
        load_dir = resolve_path(args.resume or args.save_dir or "")
        if not load_dir:
            raise SystemExit("--resume: give a checkpoint directory, or --save-dir")
        load_dir, tag = checkpoint_location(load_dir)
        fresh = not args.resume and not os.path.exists(os.path.join(load_dir, "latest"))
        path, client = (None, None) if fresh else engine.load_checkpoint(load_dir, tag=tag)
        if fresh:  # a job script that always says --resume: its first launch starts here
            if rank == 0:
                print(f"--resume: no checkpoint in --save-dir {load_dir!r} yet; starting from step 0",
                      file=sys.stderr)
        elif path is None:
            raise SystemExit(f"--resume: no DeepSpeed checkpoint found in {load_dir!r}")
        resumed_from = engine.global_steps
        if client and client.get("seed") != args.seed:
            print(f"warning: checkpoint was trained with --seed {client.get('seed')}, resuming with {args.seed}: "
                  "the data order differs from the original run", file=sys.stderr)

    is_main = rank == 0
    metrics = Metrics(args.metrics, is_main, append=resumed_from > 0)
    progress = Progress(is_main, args.steps, resumed_from, bar=not args.no_progress)
    val_batches = gift_data.eval_batches(corpus.validation, n_batches=args.eval_batches, micro=micro, seq=seq,
                                         rank=rank, world=world)
    tokens_per_step = micro * ga * world * seq
    wire = (f"gift {gift_cfg.format}/{gift_cfg.geometry.kind} via {gift_cfg.backend}" if gift_cfg.enabled
            else "native DeepSpeed reduction")
    header = (f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, {n_params / 1e6:.1f}M params | "
              f"{corpus.describe()} | world {world}, micro {micro} x accum {ga} x seq {seq} = "
              f"{tokens_per_step} tokens/step | config {args.ds_config}, ZeRO {engine.zero_optimization_stage()}, "
              f"{wire}")
    progress.log(header + (f" | resumed at step {resumed_from}" if resumed_from else ""))
    if compute_note:
        progress.log(compute_note)
    metrics.write({"event": "start", "time": time.time(), "args": vars(args), "world_size": world,
                   "ds_config": ds_config, "params": n_params, "seq_len": seq, "micro_batch": micro,
                   "grad_accum": ga, "tokens_per_step": tokens_per_step,
                   "zero_stage": engine.zero_optimization_stage(),
                   "gift": gift_cfg.model_dump() if gift_cfg.enabled else None, "resumed_from": resumed_from,
                   "compute_dtype": compute_dtype, "compute_note": compute_note, "bf16_path": bf16_path(),
                   "corpus": corpus.describe()})

    train_records, eval_records = [], []
    status = "ok"
    sync = (lambda: torch.cuda.synchronize()) if device.type == "cuda" else (lambda: None)

    def run_eval(step):
        ev = dict(evaluate(engine, val_batches, device), event="eval", step=step)
        eval_records.append(ev)
        metrics.write(ev)
        progress.log(f"step {step}: val loss {ev['val_loss']:.4f}, next-token acc {ev['val_acc']:.4f}")

    step, last_fid = resumed_from, None
    while step < args.steps:
        t0, c0 = time.perf_counter(), time.process_time()
        micro_losses = []
        for m in range(ga):
            x = gift_data.train_batch(corpus.train, seed=args.seed, step=step, micro_step=m, rank=rank,
                                      micro=micro, seq=seq).to(device)
            out = engine(input_ids=x, labels=x)
            engine.backward(out.loss)
            engine.step()
            micro_losses.append(out.loss.detach().float())
        sync()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        (loss,) = all_mean([float(torch.stack(micro_losses).mean())], device)
        rec = {"event": "train", "step": step + 1, "time": time.time(), "loss": loss, "lr": engine.get_lr()[0],
               "step_time_s": dt, "cpu_time_s": cpu,
               "tokens_per_s": tokens_per_step / dt, **gift_step_telemetry(engine, step)}
        if probe is not None:
            rec.update(probe(engine, step + 1) or {})
        train_records.append(rec)
        metrics.write(rec)
        step += 1
        last_fid = rec.get("fidelity_rel_err", last_fid)
        fid = f", fidelity {last_fid:.2e}" if last_fid is not None else ""
        progress.update(f"loss {loss:.4f}, {dt:.2f} s/step, {rec['bytes_per_elem']:.3f} B/elem{fid}")
        if progress.bar is None and (step % args.log_every == 0 or step == args.steps):
            progress.log(f"step {step}/{args.steps}: loss {loss:.4f}, lr {rec['lr']:.2e}, {dt:.3f} s/step, "
                         f"{rec['tokens_per_s']:.0f} tok/s, {rec['bytes_per_elem']:.3f} B/elem ({rec['wire']}){fid}"
                         + (f", geometry on {rec['geometry_layers']} layers" if "geometry_layers" in rec else ""))
        if not math.isfinite(loss):
            status = "diverged"
            progress.log(f"step {step}: loss is {loss}; stopping (diverged)")
            break
        if args.eval_every and step % args.eval_every == 0:
            run_eval(step)
        if args.save_dir and args.save_every and step % args.save_every == 0:
            engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"seed": args.seed, "step": step})
    if status == "ok" and step > resumed_from and (not eval_records or eval_records[-1]["step"] != step):
        run_eval(step)
    if args.save_dir and step > resumed_from and not (args.save_every and step % args.save_every == 0):
        engine.save_checkpoint(args.save_dir, tag=f"step{step}", client_state={"seed": args.seed, "step": step})
    progress.close()
    summary = dict(summarize(train_records, eval_records), status=status, resumed_from=resumed_from,
                   compute_dtype=compute_dtype)
    gift = getattr(engine, "gift", None)
    if gift is not None:  # what layers: "measured" measured and chose (1 - err_geometry / err_euclidean)
        summary["geometry_active"] = sorted(gift.geometry.whiteners)
        summary["geometry_gains"] = {k: round(v, 4) for k, v in sorted(gift.geometry.gains.items())}
    metrics.write(dict(summary, event="end"))
    metrics.close()
    if is_main:
        def fmt(x):
            return f"{x:.4f}" if finite(x) else str(x)

        print(f"done ({status}): {step} steps, train loss {fmt(summary['final_train_loss'])}, val loss "
              f"{fmt(summary.get('final_val_loss'))}, val acc {fmt(summary.get('final_val_acc'))}, median "
              f"{fmt(summary['median_step_s'])} s/step, {fmt(summary['bytes_per_elem'])} B/elem"
              + (f"; metrics in {args.metrics}" if args.metrics else ""), flush=True)
    summary["losses"] = [r["loss"] for r in train_records]
    dist.barrier()
    return summary


def run_rank(rank: int, world_size: int, argv: list) -> dict:
    """Entry for ``launch.spawn.run_ranks`` (the environment is already set per rank)."""
    return main(list(argv))


if __name__ == "__main__":
    main()
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
