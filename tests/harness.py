"""The multi-rank test harness: a small HF Llama trained through real DeepSpeed engines
(natively or with GIFT) on real text that needs no download, with the switches the tests
use to break, freeze, poison or time a run. Tests and ``tests/launched.py`` use it; what
users run is ``launch/pretrain.py``."""

from __future__ import annotations

import copy
import fnmatch
import os

from launch.data import corpus_bytes
from launch.pretrain import PRESETS


def batches(rank: int, steps: int, micro: int, seq: int, seed: int = 0):
    import torch

    data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(seed * 9973 + rank)
    for _ in range(steps):
        starts = torch.randint(0, data.numel() - seq - 1, (micro,), generator=gen)
        yield torch.stack([data[s:s + seq] for s in starts.tolist()])


def ds_config(spec: dict) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": spec.get("micro", 2),
        "gradient_accumulation_steps": spec.get("ga", 1),
        "steps_per_print": 10**9,
        "optimizer": {"type": "Adam", "params": {"lr": spec.get("lr", 3e-3), "torch_adam": True}},
        "zero_optimization": {"stage": spec.get("stage", 2),
                              "reduce_bucket_size": spec.get("bucket", 20000),
                              "allgather_bucket_size": 10**6,
                              "overlap_comm": spec.get("overlap", False),
                              "contiguous_gradients": True, **spec.get("zero", {})},
        "gradient_clipping": spec.get("clip", 0.0),
        "wall_clock_breakdown": False,
    }
    if spec.get("optimizer") == "none":  # tests: an engine without an optimizer
        del cfg["optimizer"]
    if spec.get("optimizer") == "muon":  # DeepSpeed's MuonWithAuxAdam; its Adam half is torch's
        cfg["optimizer"] = {"type": "Muon", "params": {"lr": spec.get("lr", 2e-2), "momentum": 0.95,
                                                       "torch_adam": True}}
    if spec.get("dtype") == "bf16":
        cfg["bf16"] = {"enabled": True}
        if spec.get("grad_accum_dtype"):
            cfg["data_types"] = {"grad_accum_dtype": spec["grad_accum_dtype"]}
    if spec.get("dtype") == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": spec.get("scale_power", 8), "loss_scale_window": 2}
    if spec.get("gift") is not None:
        cfg["gift"] = copy.deepcopy(spec["gift"])
        per_rank = spec.get("gift_on_rank", {}).get(str(int(os.environ.get("RANK", "0"))))
        if per_rank:  # tests of rank disagreement
            cfg["gift"].update(per_rank)
    cfg.update(spec.get("extra", {}))
    return cfg


class GroupsMpu:
    """A model-parallel unit as Megatron-style frameworks hand DeepSpeed one (``mpu``): ``tp``
    consecutive ranks form a tensor-parallel group, the ranks with the same tensor-parallel rank a
    data-parallel group ({0, 2} and {1, 3} at tp 2 of 4), so the data-parallel group is not the
    world. The model here is whole on every tensor-parallel rank (no layer is split), its parameters
    marked model-parallel by ``build_engine`` as if each were a shard: what is tested is GIFT over
    one data-parallel group of several."""

    def __init__(self, tp: int) -> None:
        import torch.distributed as dist

        world, me = dist.get_world_size(), dist.get_rank()
        self.tp = tp
        self.tp_groups = [list(range(s, s + tp)) for s in range(0, world, tp)]
        self.dp_groups = [list(range(j, world, tp)) for j in range(tp)]
        made = {tuple(g): dist.new_group(ranks=g) for g in self.tp_groups + self.dp_groups}  # all, in order
        self.tp_ranks = next(g for g in self.tp_groups if me in g)
        self.dp_ranks = next(g for g in self.dp_groups if me in g)
        self.tp_group, self.dp_group = made[tuple(self.tp_ranks)], made[tuple(self.dp_ranks)]

    def get_model_parallel_group(self):
        return self.tp_group

    def get_model_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank(group=self.tp_group)

    def get_model_parallel_world_size(self):
        return self.tp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_data_parallel_rank(self):
        import torch.distributed as dist

        return dist.get_rank(group=self.dp_group)

    def get_data_parallel_world_size(self):
        return len(self.dp_ranks)

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self.tp_ranks[0]


def build_engine(spec: dict):
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401  (the module, patched below)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import deepspeed_gift

    # Skip compiling DeepSpeed's CPU shm all-reduce op (~100 s); gloo does the work.
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    import datetime

    os.environ.update(spec.get("env", {}))  # tests: what a launcher would set (LOCAL_WORLD_SIZE)
    timeout = spec.get("dist_timeout_s")
    deepspeed.init_distributed(dist_backend=spec.get("dist_backend", "gloo"),  # gpu_check: "cuda:gloo"
                               **({"timeout": datetime.timedelta(seconds=timeout)} if timeout else {}))
    if spec.get("optimizer") == "muon" and not torch.cuda.is_available():
        from launch.pretrain import run_muon_update_eagerly

        run_muon_update_eagerly()  # as launch/pretrain.py runs it on a CPU: no inductor C++ build per test
    if spec.get("muon_ns_fp32"):  # tests: Muon's Newton-Schulz in fp32, not its half-precision default
        from deepspeed.runtime.zero.muon import original_muon

        original_muon.ns_compute_dtype = lambda ns_method="gram": torch.float32
    if spec.get("tf32_new_api"):  # gpu_check: what transformers 5 sets for tf32=True (the new TF32 API)
        torch.backends.fp32_precision = "tf32"
    torch.manual_seed(spec.get("seed", 0))
    preset = PRESETS[spec.get("preset", "tiny")]
    model = LlamaForCausalLM(LlamaConfig(**{**preset, **spec.get("model", {})}))
    for name, param in model.named_parameters():  # tests: frozen parameters
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in spec.get("freeze", [])):
            param.requires_grad_(False)
    if spec.get("unused_layer"):  # tests: a trainable layer that never gets a gradient
        width = model.config.hidden_size
        model.model.unused_proj = torch.nn.Linear(width, width)
    # builder "deepspeed": DeepSpeed's own initialize even with a gift block (the install switch's tests)
    use_gift = spec.get("gift") is not None and spec.get("builder", "gift") == "gift"
    init = deepspeed_gift.initialize if use_gift else deepspeed.initialize
    mpu = GroupsMpu(spec["tp"]) if spec.get("tp") else None  # tests: data parallelism over one group of several
    if mpu is not None:  # each tensor-parallel rank's model stands for its shard: marked as Megatron marks
        for param in model.parameters():  # shards (its data may differ from its peers'; nothing is a replica)
            param.tensor_model_parallel = True
    params = model.parameters()
    if spec.get("optimize_only"):  # tests: the optimizer is handed these parameters only (name patterns)
        params = [p for n, p in model.named_parameters() if any(fnmatch.fnmatchcase(n, pat) for pat in spec["optimize_only"])]
    engine, _, _, _ = init(model=model, model_parameters=params, config=ds_config(spec), mpu=mpu)
    return engine


def perturb_gradients(module, ulps: float, rank: int) -> None:
    """Move every element of every gradient, on every backward, by ``s * ulps * 2^-24 * |g|``
    with a sign ``s`` of +-1 drawn once per element (seeded by rank and parameter): a change of
    the size fp32 roundings make (2^-24 = u, half an ulp), in directions that stay put over the run."""
    import torch

    for index, (name, param) in enumerate(sorted(module.named_parameters())):
        if not param.requires_grad:
            continue
        gen = torch.Generator().manual_seed(7919 * rank + index)
        shape = getattr(param, "ds_shape", param.shape)  # ZeRO-3 holds a partition; the gradient is whole
        signs = torch.randint(0, 2, shape, generator=gen).to(param.dtype).mul_(2).sub_(1)
        delta = signs.mul_(ulps * 2.0 ** -24)
        param.register_hook(lambda g, delta=delta: torch.addcmul(g, g.abs(), delta))


def param_digest(module) -> str:
    """A hash of every parameter's bytes, in name order: equal on two ranks iff their replicas are."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def whole_params(engine):
    """A context in which the model's parameters are whole: ZeRO stage 3 gathers its partitions
    (every rank takes part); other stages hold them whole already."""
    import contextlib

    import deepspeed

    if engine.zero_optimization_stage() == 3:
        return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)
    return contextlib.nullcontext()


def initialize_error(rank: int, world_size: int, spec: dict) -> str:
    """Build the engine and return the error it raised ("" if none): for config tests."""
    try:
        build_engine(spec)
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


def train_many(rank: int, world_size: int, specs: list) -> list:
    """Several runs in one set of processes (spawning and importing cost more than a run)."""
    return [train(rank, world_size, spec) for spec in specs]


def train(rank: int, world_size: int, spec: dict) -> dict:
    import torch

    engine = build_engine(spec)
    import time

    if spec.get("detach"):  # tests: GIFT attached, then taken off before the first step
        import deepspeed_gift

        deepspeed_gift.detach(engine)
    hooks = sum(len(m._forward_pre_hooks) for m in engine.module.modules())  # forward pre-hooks on the model
    grad_receives = None
    if spec.get("count_recv"):  # benchmarks: bytes received in every gradient collective
        from benchmarks.exchange_bytes import count_gradient_receives

        grad_receives = count_gradient_receives(engine.optimizer, int(spec["count_recv"]))  # True: 1 per node
    bucket_owners = None
    if spec.get("record_buckets"):  # tests: the owners of every bucket, as GIFT's reducer is handed them
        bucket_owners = []
        reducer, native_reduce = engine.gift.reducer, engine.gift.reducer.reduce

        def reduce(tensor, slices, *args, **kwargs):
            owners = {}
            for s in slices:
                owners[s.dst] = owners.get(s.dst, 0) + s.numel
            bucket_owners.append(owners)
            return native_reduce(tensor, slices, *args, **kwargs)

        reducer.reduce = reduce
    host_syncs = None
    if spec.get("count_syncs"):  # tests: host conversions inside every bucket's reduction
        from benchmarks.host_syncs import count_bucket_syncs

        host_syncs = count_bucket_syncs(engine.gift)

    poison = spec.get("poison")  # tests: one parameter's gradient on one rank and step gets a nan (or is scaled)
    if poison and engine.global_rank in poison.get("ranks", [poison.get("rank")]):
        param = dict(engine.module.named_parameters())[poison["param"]]
        scale = poison.get("scale")

        def hook(g):
            if poison.get("step") is not None and engine.global_steps != poison["step"]:
                return g
            return g * scale if scale is not None else g + float("nan")

        param.register_hook(hook)
    if spec.get("perturb_ulps"):  # tests/spread.py: every gradient element moved by +-k fp32 ulps
        perturb_gradients(engine.module, spec["perturb_ulps"], engine.global_rank)
    losses, step_times, rss_steps, digests, grad_norms = [], [], {}, [], []
    micro, ga, seq = spec.get("micro", 2), spec.get("ga", 1), spec.get("seq", 32)
    done = 0
    if spec.get("resume"):
        engine.load_checkpoint(spec["resume"], load_optimizer_states=spec.get("load_optimizer_states", True))
        done = engine.global_steps * ga  # the batches already consumed (data depends on the step only)
    for i, tokens in enumerate(batches(engine.global_rank, spec.get("steps", 4) * ga, micro, seq,
                                       spec.get("data_seed", 0))):
        if i < done:
            continue
        die = spec.get("die")  # tests: this rank exits or hangs at this step
        if die and engine.global_rank == die["rank"] and engine.global_steps == die["step"]:
            if die["mode"] == "exit":
                os._exit(3)
            time.sleep(10**6)
        t0 = time.perf_counter()
        tokens = tokens.to(engine.device)
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
        step_times.append(time.perf_counter() - t0)
        losses.append(float(out.loss.detach()))
        if (i + 1) % ga == 0:  # tests compare every rank's replicas after every step
            with whole_params(engine):
                digests.append(param_digest(engine.module))
            norm = engine.get_global_grad_norm()
            grad_norms.append(None if norm is None else float(norm))
        if spec.get("rss_at") and engine.global_steps in spec["rss_at"] and (i + 1) % ga == 0:
            import resource

            rss_steps[engine.global_steps] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # MiB
        if spec.get("save_at") == engine.global_steps and (i + 1) % ga == 0:
            engine.save_checkpoint(spec["save_dir"])
    with whole_params(engine):
        params = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    opt = engine.optimizer
    split = []  # Muon matrices that ZeRO's partitions cut (tests assert the case they cover happens)
    if hasattr(opt, "param_to_partition_ids"):
        for name, p in engine.module.named_parameters():
            if getattr(p, "use_muon", False) and p.requires_grad:
                group = next(i for i, g in enumerate(opt.bit16_groups) if any(q is p for q in g))
                if len(opt.param_to_partition_ids[group][opt.get_param_id(p)]) > 1:
                    split.append(name)
    gift = getattr(engine, "gift", None)
    result = {"losses": losses, "params": params, "digests": digests, "grad_norms": grad_norms, "skipped": getattr(engine, "skipped_steps", 0),
              "step_times": step_times, "peak_rss_mib": rss_steps, "split_muon": split, "hooks": hooks,
              "host_syncs": host_syncs, "grad_receives": grad_receives, "bucket_owners": bucket_owners}
    if gift is not None:
        g = gift.geometry
        result["backend"] = gift.comm.name
        result.update(records=list(gift.records), version=g.version, active=sorted(g.active),
                      kinds=dict(sorted(g.active.items())), gains=dict(g.gains),
                      whitener_digest={f"{kind}:{n}": [t.double().sum().item() for t in w.to_tensors()]
                                       for kind, maps in sorted(g.transforms.items()) for n, w in sorted(maps.items())})
    if hasattr(engine.optimizer, "cur_scale"):
        result["loss_scale"] = float(engine.optimizer.cur_scale)
    torch.distributed.barrier()
    return result


# FP8 + kfac with stochastic rounding and error feedback, refreshed every 2 steps: every piece of
# GIFT's state that a checkpoint carries is in use
FP8_KFAC_EF = {"format": "fp8_e4m3", "rounding": "stochastic", "error_feedback": True, "layers": "all",
               "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1}}


def resumed_as_uninterrupted(base: dict, save_dir: str, save_at: int, others=()):
    """Run ``base`` uninterrupted, and saved at step ``save_at`` (with ``others`` in the same
    processes), then resumed from the save; checks GIFT's files in the checkpoint and that the
    saved and the resumed run give the uninterrupted run's losses. Returns (uninterrupted,
    resumed, *others) of rank 0."""
    from launch.spawn import run_ranks

    full, first, *rest = run_ranks(train_many, 2, [base, dict(base, steps=save_at, save_at=save_at,
                                                              save_dir=save_dir), *others])[0]
    folder = os.path.join(save_dir, f"global_step{save_at}")
    assert sorted(f for f in os.listdir(folder) if f.startswith("gift_rank")) == \
        ["gift_rank0.pt", "gift_rank0_residuals.bin", "gift_rank1.pt", "gift_rank1_residuals.bin"]
    (resumed,) = run_ranks(train_many, 2, [dict(base, resume=save_dir)])[0]
    assert first["losses"] == full["losses"][:save_at] and resumed["losses"] == full["losses"][save_at:]
    assert resumed["whitener_digest"] == full["whitener_digest"]
    return (full, resumed, *rest)
