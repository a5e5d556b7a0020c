"""docker/k8s/*.yaml, checked without a cluster: they parse, every command they run exists in
the CLI (or is torchrun running a script that accepts its arguments), once Kubernetes has put
each pod's JOB_COMPLETION_INDEX in, and the three Jobs fit together: the Indexed Job packs
``--num-parts`` parts, one per index, into the folders merge reads, and training reads what
merge wrote."""

from __future__ import annotations

import os
import shlex
from typing import Any

import pytest
import yaml
from test_docker_files import DOCKER, check_cli, check_script, instructions

K8S = os.path.join(DOCKER, "k8s")
INDEX = "$(JOB_COMPLETION_INDEX)"


def docs(name: str) -> list[dict[str, Any]]:
    with open(os.path.join(K8S, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def job(name: str) -> dict[str, Any]:
    (found,) = [d for d in docs(name) if d["kind"] == "Job"]
    assert found["apiVersion"] == "batch/v1"
    return found


def container(j: dict[str, Any]) -> dict[str, Any]:
    (c,) = j["spec"]["template"]["spec"]["containers"]
    return c


def argv(c: dict[str, Any], index: int | None = None) -> list[str]:
    """What the container runs, as Kubernetes expands it for the pod with ``index``."""
    args = list(c.get("command", ["shardloader"])) + list(c.get("args", []))
    if index is not None:
        args = [a.replace(INDEX, str(index)) for a in args]
    return args


def option(args: list[str], name: str) -> str:
    assert name in args, f"{name} missing from {shlex.join(args)}"
    return args[args.index(name) + 1]


FILES = sorted(n for n in os.listdir(K8S) if n.endswith(".yaml"))


def test_the_manifests_are_there():
    assert FILES == ["merge.yaml", "pack-parts.yaml", "train.yaml"]


@pytest.mark.parametrize("name", FILES)
def test_every_command_exists_for_every_index(name):
    j = job(name)
    c = container(j)
    assert c["image"].startswith("shardloader:")
    indexed = j["spec"].get("completionMode") == "Indexed"
    for index in range(j["spec"].get("completions", 1)) if indexed else [None]:
        args = argv(c, index)
        assert INDEX not in " ".join(args)
        if args[0] == "shardloader":
            check_cli(args[1:])
        else:
            assert args[0] == "torchrun", args
            from torch.distributed.run import get_args_parser

            run = get_args_parser().parse_args(args[1:])
            check_script(["python", run.training_script, *run.training_script_args])


@pytest.mark.parametrize("name", FILES)
def test_pods_run_as_the_images_user_and_never_restart_in_place(name):
    spec = job(name)["spec"]["template"]["spec"]
    uid = instructions("USER")[-1].split(":")[0]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert str(spec["securityContext"]["runAsUser"]) == uid
    assert spec["restartPolicy"] == "Never"  # a retry is a new pod: the Job's backoff decides


def test_the_indexed_job_packs_one_part_per_index():
    j = job("pack-parts.yaml")
    spec = j["spec"]
    args = argv(container(j))
    assert args[:2] == ["shardloader", "pack"]
    parts = int(option(args, "--num-parts"))
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == parts > 1
    assert "--part" not in args, "the part comes from JOB_COMPLETION_INDEX"
    assert INDEX in args[3], "each part writes its own folder"
    assert "--resume" in args, "a retried pod keeps the shards it finished"


def test_merge_reads_every_part_and_training_reads_the_merge():
    pack = argv(container(job("pack-parts.yaml")))
    parts = int(option(pack, "--num-parts"))
    merge = argv(container(job("merge.yaml")))
    assert merge[:2] == ["shardloader", "merge"]
    positionals = [a for a in merge[2:] if not a.startswith("-")]
    *inputs, out = positionals
    assert inputs == [pack[3].replace(INDEX, str(i)) for i in range(parts)]
    assert all(p.startswith(out.rstrip("/") + "/") for p in inputs), "parts inside OUT: referenced"
    train = argv(container(job("train.yaml")), 0)
    assert out in train, "training reads the merged dataset"


def test_training_ranks_find_each_other():
    j = job("train.yaml")
    spec, pod = j["spec"], j["spec"]["template"]["spec"]
    args = argv(container(j))
    (service,) = [d for d in docs("train.yaml") if d["kind"] == "Service"]
    assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
    assert pod["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"] == {"batch.kubernetes.io/job-name": j["metadata"]["name"]}
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"] == int(option(args, "--nnodes"))
    assert option(args, "--node-rank") == INDEX
    head = f"{j['metadata']['name']}-0.{service['metadata']['name']}"
    assert option(args, "--master-addr") == head
    port = int(option(args, "--master-port"))
    assert port in [p["port"] for p in service["spec"]["ports"]]


def test_the_checks_catch_a_wrong_manifest():
    with pytest.raises(AssertionError):
        check_cli(["pack", "src", "out", "--num-part", "4"])
    with pytest.raises(SystemExit):
        check_script(["python", "tools/train_image.py", "s3://x", "--no-such-flag"])
