"""The multi-node path on a real Ray cluster inside this machine (``ray.cluster_utils.Cluster``).

One cluster serves the module (start-up costs ~30 s on 2 cores): three
raylets, each with its own custom node resource and a role label::

    node A  CPU 2  (the head: the driver runs here)  {node_a: 2, trainer: 2}               labels unirl/role=trainer
    node B  CPU 2  {node_b: 2, trainer: 2, rollout: 1}   labels unirl/role=rollout
    node C  CPU 1  {node_c: 1, rollout: 1}               labels unirl/role=rollout

What it proves: placement by resources and labels lands processes where a recipe says (and an
impossible layout fails at once, naming the field and the nodes); FSDP ranks split over two nodes
train exactly like the ranks packed on one; a weight sync from an actor on node A reaches two vLLM
replicas on nodes B and C through Ray's object store, one receipt each; losing node C mid-rollout
is a named error within 60 s; ``unirl train`` runs as a Ray job's entrypoint; and the demo recipe, disaggregated (actor on A, engine on B), learns,
stops with a named error when node B dies, and resumes from its checkpoint with the engine on A. The
last two tests remove nodes C and then B, so they run last, in that order.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.vllm]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
ROOT = Path(__file__).resolve().parents[2]
# the raylets start in this process and hand its environment to every worker: a warm inductor cache
# saves each replica the ~16 s cold compile of vLLM's sampler ops
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".cache" / "inductor"))

BUILD = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
FSDP = {"world_size": 2, "cpus_per_rank": 0.5, "step_timeout_s": 120, "init_timeout_s": 120}
ROLLOUT = {"labels": {"unirl/role": "rollout"}}


@pytest.fixture(scope="module")
def cluster():
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # the head is node A: the driver shares a node with the actor, not with the engine replicas
    c = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "resources": {"node_a": 2, "trainer": 2}, "labels": {"unirl/role": "trainer"},
        "include_dashboard": True})  # the job server (``ray job submit``) lives in the dashboard
    nodes = {
        "a": c.head_node,
        "b": c.add_node(num_cpus=2, resources={"node_b": 2, "trainer": 2, "rollout": 1}, **ROLLOUT),
        "c": c.add_node(num_cpus=1, resources={"node_c": 1, "rollout": 1}, **ROLLOUT),
    }
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c, {k: n.node_id for k, n in nodes.items()}
    ray.shutdown()
    c.shutdown()


def make_config(tmp, **options):
    from unirl.api import RunConfig

    return RunConfig.model_validate({
        "run": {"output_dir": str(tmp)},
        "model": {"build": BUILD},
        "actor": {"name": "fsdp", "lr": 1e-3, "micro_batch_size": 2, "grad_clip": 1.0,
                  "options": {**FSDP, **options}},
        "rollout": {"engine": "vllm", "n": 2, "max_new_tokens": 8,
                    "options": {"placement": {"node_labels": {"unirl/role": "rollout"}, "strategy": "SPREAD"},
                                "replicas": 2, "ray_num_cpus": 0.5, "kv_cache_gb": 0.25, "max_model_len": 512,
                                "ignore_eos": True}},
        "weight_sync": {"name": "vllm"},
        "trainer": {"prompts_per_step": 4},
    })


def fsdp_actor(config):
    from unirl.api import Qwen3Adapter, build_actor, build_runtime, load_kernel

    adapter = Qwen3Adapter()
    return build_actor(config, adapter=adapter, runtime=build_runtime(config, load_kernel(), adapter=adapter))


def samples_and_batch(seed=0):
    import torch

    from unirl.api import Sample

    rng = random.Random(seed)
    out = []
    for g in range(4):
        prompt = [rng.randrange(3, 200) for _ in range(rng.randrange(3, 9))]
        for k in range(2):
            m = rng.randrange(2, 9)
            out.append(Sample(id=f"p{g}/{k}", prompt_ids=prompt, loss_mask=[1] * m,
                              response_ids=[rng.randrange(3, 200) for _ in range(m)]))
    gen = torch.Generator().manual_seed(seed + 1)
    batch = {"advantages": [torch.randn(len(s.response_ids), generator=gen) for s in out]}
    return out, batch


@pytest.fixture(scope="module")
def actor_a(cluster, tmp_path_factory):
    """Two FSDP ranks packed on node A (the one-node run, and the sync's source)."""
    actor = fsdp_actor(make_config(tmp_path_factory.mktemp("one"), placement={"resources": {"node_a": 1}}))
    yield actor
    actor.close()


def test_placement_errors_name_the_field_and_the_nodes(cluster):
    from pydantic import ValidationError

    from unirl.api import ConfigError, Placement
    from unirl_fsdp.options import FSDPOptions
    from unirl_vllm.options import VLLMOptions

    with pytest.raises(ValidationError, match="set by the plugin's own options"):
        FSDPOptions.model_validate({"placement": {"resources": {"CPU": 1}}})
    with pytest.raises(ValidationError, match="replicas: 2 engine hosts cannot share"):
        VLLMOptions.model_validate({"replicas": 2})
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"actor.options.placement: no node .* node_b=2"):
        Placement(resources={"gpu_pool": 1}).placement_group(1, {"CPU": 0.5}, field="actor.options.placement",
                                                             timeout_s=60)
    with pytest.raises(ConfigError, match="no node"):
        Placement(node_labels={"unirl/role": "judge"}).placement_group(1, {}, field="f", timeout_s=60)
    assert time.monotonic() - t0 < 10  # found at once, not after the placement timeout


def test_fsdp_ranks_on_two_nodes_match_one_node(cluster, actor_a, tmp_path):
    _, nodes = cluster
    split = fsdp_actor(make_config(tmp_path, placement={"resources": {"trainer": 1}, "strategy": "STRICT_SPREAD"}))
    try:
        assert [i["node_id"] for i in actor_a.group.info] == [nodes["a"]] * 2
        assert {i["node_id"] for i in split.group.info} == {nodes["a"], nodes["b"]}
        w0 = dict(split.named_weights())
        losses = []
        for step in range(2):
            samples, batch = samples_and_batch(step)
            one = actor_a.train_step(samples, batch)
            two = split.train_step(samples, batch)
            losses.append((one["loss"], two["loss"]))
        assert all(abs(a - b) < 1e-6 for a, b in losses), losses
        w_one, w_two = dict(actor_a.named_weights()), dict(split.named_weights())
        assert set(w_one) == set(w_two)
        diff = max(float((w_one[k] - w_two[k]).abs().max()) for k in w_one)
        moved = max(float((w0[k] - w_two[k]).abs().max()) for k in w0)
        assert diff < 1e-6 and moved > 1e-4, (diff, moved)

        # a rank lost on a multi-node group is named with its node and what ran there
        import ray

        from unirl_fsdp.group import RankFailedError

        on_b = next(r for r, i in enumerate(split.group.info) if i["node_id"] == nodes["b"])
        ray.kill(split.group.workers[on_b], no_restart=True)  # the rank's Ray actor dies, as a lost node's would
        with pytest.raises(RankFailedError) as err:
            split.train_step(*samples_and_batch(5))
        msg = str(err.value)
        assert f"rank {on_b}" in msg and nodes["b"][:8] in msg and "node_b=2" in msg
        assert f"which ran rank(s) [{on_b}]" in msg
    finally:
        split.close()


@pytest.fixture(scope="module")
def replicas(cluster, actor_a):
    from unirl.api import Qwen3Adapter, build_engine

    engine = build_engine(actor_a.config, adapter=Qwen3Adapter())
    yield engine
    engine.close()


def test_sync_from_node_a_reaches_two_replicas_through_the_object_store(cluster, actor_a, replicas):
    import torch

    from unirl.api import Sample, SamplingParams, VersionLedger
    from unirl_vllm.sync import VLLMWeightSync

    _, nodes = cluster
    engine = replicas
    assert sorted(r["node_id"] for r in engine.replicas) == sorted([nodes["b"], nodes["c"]])
    assert engine.transports() == ["object_store", "object_store"]
    receipts, manifest = VLLMWeightSync(config=actor_a.config).publish(actor_a, engine, version=1)
    assert len(receipts) == 2 and {r.transport for r in receipts} == {"object_store"}
    assert {r.node for r in receipts} == {nodes["b"], nodes["c"]}
    assert all(r.fingerprint == manifest and r.version == 1 for r in receipts)
    ledger = VersionLedger()
    ledger.commit(1, receipts, manifest)
    assert ledger.history[-1]["transports"] == ["object_store"] and ledger.history[-1]["workers"] == [0, 1]

    # requests spread over both replicas, and each serves the actor's weights (replay oracle)
    got = engine.generate([Sample(id=f"g{i}", prompt_ids=[2, 40 + i, 41, 42], seed=i) for i in range(4)],
                          SamplingParams(max_new_tokens=6))
    assert {s.requests[-1].worker for s in got} == {"0", "1"}
    assert all(s.versions == [1] * 6 for s in got)
    replay = actor_a.logprobs(got)
    diff = max(float((torch.tensor(s.rollout_logprobs) - r).abs().max()) for s, r in zip(got, replay, strict=True))
    assert diff < 1e-4, diff


def test_unirl_train_runs_as_a_ray_job(cluster, tmp_path):
    """``unirl train`` as the entrypoint of a Ray job (what ``ray job submit -- unirl train ...`` sends).

    The job's driver runs on the head with ``RAY_ADDRESS`` set. Its FSDP ranks ask for the ``trainer``
    resource, which only this cluster's nodes have, so a driver that started a Ray of its own instead
    of joining could not place them.
    """
    import json
    import shlex
    import sys

    from ray.job_submission import JobStatus, JobSubmissionClient

    c, _ = cluster
    args = [sys.executable, "-m", "unirl.cli", "train", str(ROOT / "recipes" / "arith-tiny-fsdp.yaml"),
            f"run.output_dir={tmp_path}", "run.name=job", "trainer.steps=2", "sft.steps=5", "trainer.eval_every=0",
            "trainer.eval_k=1", "trainer.progress=false", "trainer.plot=false", "model.build={hidden_size: 64, intermediate_size: 128}",
            "actor.options.cpus_per_rank=0.5", "actor.options.placement={resources: {trainer: 0.5}}"]
    client = JobSubmissionClient(f"http://{c.head_node.address_info['webui_url']}")
    job = client.submit_job(entrypoint=shlex.join(args), runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    deadline = time.monotonic() + 600
    while (status := client.get_job_status(job)) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
        assert time.monotonic() < deadline, client.get_job_logs(job)[-4000:]
        time.sleep(1.0)
    logs = client.get_job_logs(job)
    assert status == JobStatus.SUCCEEDED, logs[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in lines] == [0, 1, 2] and lines[-1]["version"] == 3


def test_losing_a_node_mid_rollout_is_a_named_error(cluster, replicas):
    from unirl.api import Sample, SamplingParams
    from unirl_vllm.engine import EngineReplicaLost

    c, nodes = cluster
    engine = replicas
    doomed = next(i for i, r in enumerate(engine.replicas) if r["node_id"] == nodes["c"])
    samples = [Sample(id=f"k{i}", prompt_ids=[2, 50 + i, 41, 42], seed=i) for i in range(16)]
    handle = engine.submit(samples, SamplingParams(max_new_tokens=500))  # long enough to be mid-way
    deadline = time.monotonic() + 60
    while not any(s.requests[-1].first_token_ms for s in samples):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    node_c = next(n for n in c.worker_nodes if n.node_id == nodes["c"])
    t0 = time.monotonic()
    c.remove_node(node_c, allow_graceful=False)  # SIGKILL its raylet and everything under it
    with pytest.raises(EngineReplicaLost) as err:
        while time.monotonic() - t0 < 90:
            engine.poll(handle, timeout=1.0)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    print(f"node loss surfaced after {elapsed:.1f}s: {msg}")
    assert elapsed < 60
    assert f"replica {doomed}" in msg and nodes["c"][:8] in msg and "node_c=1" in msg


@pytest.mark.timeout(1800)  # the full 60-step demo, twice started: ~4 min idle, more under load
def test_disaggregated_demo_learns_then_survives_losing_the_rollout_node(cluster, tmp_path):
    """The demo recipe with the actor on node A (the driver's node) and its vLLM engine on node B.

    Node B's raylet is SIGKILLed right after the step-30 checkpoint, which lands mid-rollout of step
    31 or, on a fast machine, in the weight sync after it. The run must stop with the engine's named
    error within 60 s. It then resumes from that
    checkpoint with ``rollout.options.placement`` moved to node A (by its role label: the one-node FSDP
fixture holds all of node A's ``node_a`` resource), and finishes the 60 steps. Held-out
    avg@4 must rise in the disaggregated half, and by the demo's bar (+0.20) over the whole run.
    This test runs after the node-C test and removes node B: it must stay the module's last.
    """
    import json
    import threading

    from unirl.api import WeightSyncError, load_config, load_kernel, train
    from unirl_vllm.engine import EngineReplicaLost

    c, nodes = cluster
    common = [f"run.output_dir={tmp_path}", "run.name=disagg", "trainer.progress=false", "trainer.plot=false",
              "trainer.save_every=10", "rollout.options.ray_num_cpus=0.5", "rollout.options.kv_cache_gb=0.25",
              "rollout.options.max_model_len=512"]
    on_b = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml",
                       [*common, "rollout.options.placement={resources: {node_b: 0.5}}"])
    run = tmp_path / "disagg"
    killed: dict[str, float] = {}

    def kill_node_b_after_step_30():
        deadline = time.monotonic() + 1200
        while time.monotonic() < deadline:
            if (run / "checkpoints" / "step_000030" / "meta.json").is_file():
                break
            time.sleep(0.05)
        else:
            return
        node_b = next(n for n in c.worker_nodes if n.node_id == nodes["b"])
        killed["t"] = time.monotonic()
        c.remove_node(node_b, allow_graceful=False)

    killer = threading.Thread(target=kill_node_b_after_step_30, daemon=True)
    killer.start()
    # the kill lands in step 31's rollout (EngineReplicaLost) or, when that rollout was quicker than
    # the kill, in the weight sync after it (WeightSyncError naming the lost replica); both are named
    with pytest.raises((EngineReplicaLost, WeightSyncError)) as err:
        train(on_b, load_kernel())
    surfaced = time.monotonic() - killed["t"]
    killer.join(timeout=5)
    msg = str(err.value)
    print(f"\nnode B loss surfaced after {surfaced:.1f}s ({type(err.value).__name__}): {msg}")
    assert surfaced < 60
    assert nodes["b"][:8] in msg and "node_b=2" in msg
    if isinstance(err.value, WeightSyncError):
        assert "was lost during sync" in msg and "serves version" in msg
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(h["step"] for h in lines) in (30, 31)  # nothing past the step the node died in

    on_a = load_config(ROOT / "recipes" / "arith-tiny-vllm.yaml",
                       [*common, "run.resume=true",
                        "rollout.options.placement={node_labels: {unirl/role: trainer}}"])
    result = train(on_a, load_kernel())
    steps = [h for h in result.history if h["step"] > 0]
    assert [h["step"] for h in steps] == list(range(1, 61)), "steps 1-30 kept, 31-60 trained after the move"
    evals = {h["step"]: h["eval"] for h in result.history if "eval" in h}
    print(f"disaggregated avg@4: {evals}")
    assert evals[30] > evals[0] + 0.05, "the half with the engine on node B learns"
    assert result.eval_after - result.eval_before >= 0.20
