"""Run by tests/workers/test_ray_pool.py in a process of its own (one Ray per process): a two-node Ray cluster on
this machine (`ray.cluster_utils.Cluster`, one logical CPU per node), joined by address as a run joins a real
cluster; two rollout workers land on different nodes, load a snapshot published through the object store (pulled
across nodes), and roll out what the learner would from the same weights and seeds. Prints NODES and OK lines."""

import torch
from ray.cluster_utils import Cluster

from dllm_rl.rollout.generate import TextGenerator
from dllm_rl.workers.ray_pool import RayStore, WorkerPool, start_ray, stop_ray
from dllm_rl.workers.versions import Publisher
from tests.workers.test_ray_pool import MODEL, PROMPTS, SAMPLER, perturbed_policy

cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 80 * 2**20,
                                                        "include_dashboard": False})  # under $RAY_TMPDIR
try:
    cluster.add_node(num_cpus=1, object_store_memory=80 * 2**20)
    cluster.wait_for_nodes()
    start_ray(address=cluster.address)
    torch.set_num_threads(1)
    policy, tokenizer = perturbed_policy(seed=3)
    pool = WorkerPool(2, MODEL, SAMPLER, bf16=False, timeout_s=120)
    try:
        nodes = [a.node.remote() for a in pool.actors]
        import ray

        nodes = ray.get(nodes, timeout=120)
        print("NODES", len(set(nodes)), flush=True)
        snapshot = Publisher(RayStore()).publish(policy.model.state_dict(), step=5)
        pool.load(snapshot)
        chunks = [(PROMPTS[:2], [21, 22]), (PROMPTS[2:], [23, 24])]
        got = pool.generate(chunks)
    finally:
        pool.close()
    with torch.no_grad():
        expected = [TextGenerator(policy, tokenizer, **SAMPLER).sample(p, s) for p, s in chunks]
    same = all(torch.equal(g.samples.sequences_BL, e.sequences_BL) and g.checksum == snapshot.checksum
               for g, e in zip(got, expected))
    print("OK" if same else "DIFFERENT", flush=True)
finally:
    stop_ray()
    cluster.shutdown()
