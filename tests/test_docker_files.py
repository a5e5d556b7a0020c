"""docker/Dockerfile and docker/compose.yaml, checked without a Docker engine: they parse, the
image is slim and non-root with CPU torch, every ``shardloader`` command and option they run
exists in the CLI, the scripts they run accept their arguments, and the wiring fits."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shlex
import sys
from typing import Any
from urllib.parse import urlsplit

import click
import pytest
import yaml

from shardloader.cli import main
from shardloader.service.options import is_loopback

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")


# -- Dockerfile -------------------------------------------------------------------------------


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    with open(os.path.join(DOCKER, "Dockerfile")) as f:
        for raw in f:
            line = raw.rstrip("\n")
            if not pending and (not line.strip() or line.lstrip().startswith("#")):
                continue
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            name, _, args = text.partition(" ")
            out.append((name.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def instructions(name: str) -> list[str]:
    return [args for n, args in dockerfile() if n == name]


def test_dockerfile_is_slim_and_drops_root():
    steps = dockerfile()
    assert steps[0][0] == "FROM" and "slim" in steps[0][1]
    users = [i for i, (n, _) in enumerate(steps) if n == "USER"]
    runs = [i for i, (n, _) in enumerate(steps) if n == "RUN"]
    assert users and users[-1] > max(runs), "the image must end as a non-root USER"
    user = steps[users[-1]][1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), "use a numeric non-root uid"
    created = " ".join(instructions("RUN"))
    assert f"--uid {user}" in created, "the uid must exist in the image"


def test_the_shard_cache_is_where_the_user_can_write():
    """The default cache root (~/.cache/shardloader) would be under the user's home, /app,
    which root owns: the image points SHARDLOADER_CACHE_DIR into /data, which the user owns."""
    envs = dict(pair.split("=", 1) for args in instructions("ENV") for pair in args.split())
    cache = envs.get("SHARDLOADER_CACHE_DIR", "")
    chown = " ".join(a for a in instructions("RUN") if "chown shardloader" in a)
    assert cache.startswith("/data/"), cache
    assert " /data " in f"{chown.split('chown', 1)[-1]} "  # /data belongs to the user


def test_dockerfile_installs_pinned_cpu_torch_and_existing_extras():
    runs = instructions("RUN")
    torch_lines = [r for r in runs if "torch==" in r]
    assert torch_lines, "torch is installed explicitly, pinned"
    args = shlex.split(torch_lines[0])
    assert any(a.startswith("torch==") and a.count(".") == 2 for a in args)
    assert args[args.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"
    assert runs.index(torch_lines[0]) < min(i for i, r in enumerate(runs) if '".[' in r), (
        "CPU torch must be in place before the package pulls the default (CUDA) wheel"
    )
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    for run in runs:
        for arg in shlex.split(run):
            if arg.startswith(".["):
                wanted = arg[2:].rstrip("]").split(",")
                assert set(wanted) <= set(extras) and {"s3", "serve"} <= set(wanted)


def _copy_sources() -> list[str]:
    sources = []
    for args in instructions("COPY"):
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        sources += parts[:-1]
    return sources


def test_dockerfile_copies_what_exists():
    missing = [
        s for s in _copy_sources() if s != "README.md" and not os.path.exists(os.path.join(ROOT, s))
    ]
    assert not missing, f"COPY sources missing from the build context: {missing}"
    assert {"pyproject.toml", "shardloader", "tools"} <= set(_copy_sources())


def test_dockerfile_copies_the_readme_pyproject_needs():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        readme = tomllib.load(f)["project"].get("readme")
    assert readme in _copy_sources(), "pip install . reads the readme pyproject names"
    if not os.path.exists(os.path.join(ROOT, readme)):
        pytest.skip(f"{readme} is not written yet; the image build needs it")


def test_dockerfile_entrypoint_is_the_cli():
    (entry,) = instructions("ENTRYPOINT")
    assert json.loads(entry) == ["shardloader"]
    (cmd,) = instructions("CMD")
    check_cli(json.loads(cmd))
    (port,) = instructions("EXPOSE")
    assert port == "8470"


# -- checking argv against the CLI and the scripts ----------------------------------------------


def check_cli(args: list[str]) -> click.Command | None:
    """Fail unless ``shardloader *args`` names a command whose options and choices exist."""
    if args in (["--help"], ["--version"]):
        return None
    assert args and args[0] in main.commands, f"no such command: shardloader {args[0]}"
    cmd = main.commands[args[0]]
    options: dict[str, click.Option] = {}
    for param in cmd.params:
        if isinstance(param, click.Option):
            for name in (*param.opts, *param.secondary_opts):
                options[name] = param
    positionals = []
    rest = iter(args[1:])
    for token in rest:
        if token.startswith("-"):
            name, eq, value = token.partition("=")
            assert name in options or name == "--help", f"shardloader {args[0]}: no option {name}"
            param = options.get(name)
            if param is None or param.is_flag or param.count:
                continue
            if not eq:
                value = next(rest, None)
                assert value is not None, f"shardloader {args[0]} {name} needs a value"
            if isinstance(param.type, click.Choice):
                assert value in param.type.choices, f"{name} {value!r}: not a choice"
            else:
                param.type.convert(value, param, None)  # ints, ranges: raise if invalid
        else:
            positionals.append(token)
    arguments = [p for p in cmd.params if isinstance(p, click.Argument)]
    fixed = sum(p.nargs for p in arguments if p.nargs > 0)
    variadic = [p for p in arguments if p.nargs < 0]  # merge PART_DIRS... OUT
    least = fixed + sum(1 for p in variadic if p.required)
    ok = len(positionals) >= least if variadic else len(positionals) == fixed
    assert ok, f"shardloader {args[0]} takes {len(arguments)} arguments, got {positionals}"
    return cmd


def check_script(argv: list[str]) -> None:
    """``python tools/x.py ...``: the script exists and its ``parse`` accepts the arguments;
    ``python -c CODE``: the code compiles and the tools it imports exist."""
    assert argv[0] == "python"
    if argv[1] == "-c":
        tree = ast.parse(argv[2])
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    path = os.path.join(ROOT, "tools", f"{alias.name}.py")
                    if alias.name not in sys.stdlib_module_names:
                        assert os.path.exists(path), f"python -c imports tools/{alias.name}.py"
                        check_calls(tree, alias.name, path)
        return
    path = os.path.join(ROOT, argv[1])
    assert os.path.exists(path), f"{argv[1]} does not exist"
    spec = importlib.util.spec_from_file_location("_compose_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert hasattr(module, "parse"), f"{argv[1]} has no parse(argv) to check the arguments"
    module.parse(argv[2:])  # argparse exits on an unknown option


def check_calls(tree: ast.AST, module: str, path: str) -> None:
    with open(path) as f:
        defined = {n.name for n in ast.parse(f.read()).body if isinstance(n, ast.FunctionDef)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == module
        ):
            assert node.attr in defined, f"tools/{module}.py defines no {node.attr}()"


# -- compose ----------------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    with open(os.path.join(DOCKER, "compose.yaml")) as f:
        return yaml.safe_load(f)


def argv(service: dict[str, Any]) -> list[str]:
    entry = service.get("entrypoint", ["shardloader"] if uses_image(service) else [])
    command = service.get("command", [])
    entry = shlex.split(entry) if isinstance(entry, str) else list(entry)
    command = shlex.split(command) if isinstance(command, str) else list(command)
    return entry + command


def uses_image(service: dict[str, Any]) -> bool:
    build = service.get("build") or {}
    return build.get("dockerfile") == "docker/Dockerfile"


SERVICES = sorted(compose()["services"])


@pytest.mark.parametrize("name", SERVICES)
def test_every_command_exists(name):
    service = compose()["services"][name]
    if not uses_image(service):
        assert "image" in service and ":" in service["image"], f"{name}: pin the image tag"
        return
    assert os.path.normpath(os.path.join(DOCKER, service["build"]["context"])) == ROOT
    args = argv(service)
    if args[0] == "shardloader":
        check_cli(args[1:])
    else:
        check_script(args)


def test_services_depend_and_mount_what_exists():
    doc = compose()
    services, volumes = doc["services"], set(doc.get("volumes") or {})
    for name, service in services.items():
        for dep, spec in (service.get("depends_on") or {}).items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert spec["condition"] in (
                "service_started",
                "service_healthy",
                "service_completed_successfully",
            )
            if spec["condition"] == "service_healthy":
                assert "healthcheck" in services[dep], f"{dep} has no healthcheck"
        for mount in service.get("volumes") or []:
            source = mount.split(":")[0]
            assert source in volumes, f"{name} mounts undeclared volume {source}"


def test_the_pipeline_is_wired_end_to_end():
    services = compose()["services"]
    store = services["store"]
    assert store["image"].startswith(("minio/minio:", "motoserver/moto:"))
    pack = argv(services["pack"])
    serve = argv(services["serve"])
    assert pack[:2] == ["shardloader", "pack"] and serve[:2] == ["shardloader", "serve"]
    url = pack[3]
    assert url.startswith("s3://") and serve[2] == url, "serve reads what pack wrote"
    bucket = urlsplit(url).netloc
    assert bucket in " ".join(argv(services["bucket"]) + [str(services["bucket"])])
    for name in ("pack", "serve"):
        env = services[name]["environment"]
        assert urlsplit(env["AWS_ENDPOINT_URL"]).hostname == "store"
    assert {"pack", "token"} <= set(services["serve"]["depends_on"])
    assert "bucket" in services["pack"]["depends_on"]


def option(args: list[str], name: str, default: str | None = None) -> str | None:
    return args[args.index(name) + 1] if name in args else default


def test_the_trainer_reads_the_service_with_its_token():
    services = compose()["services"]
    serve, trainer = argv(services["serve"]), argv(services["trainer"])
    host, port = option(serve, "--host", "127.0.0.1"), option(serve, "--port", "8470")
    token = option(serve, "--token-file")
    assert is_loopback(host) or token, "a non-loopback bind needs --token-file"
    remote = urlsplit(option(trainer, "--remote") or "")
    assert (remote.hostname, str(remote.port)) == ("serve", port)
    assert services["trainer"]["depends_on"]["serve"]["condition"] == "service_healthy"
    assert f":{port}/health" in " ".join(services["serve"]["healthcheck"]["test"])
    assert services["trainer"]["environment"]["SHARDLOADER_TOKEN_FILE"] == token
    mounted = {m.split(":")[1] for m in services["trainer"]["volumes"]}
    assert os.path.dirname(token) in mounted
    assert os.path.dirname(token) in {m.split(":")[1] for m in services["serve"]["volumes"]}
    assert option(trainer, "--seed", "0") == option(serve, "--seed", "0")  # else 409
    published = services["serve"].get("ports", [])
    assert all(p.startswith("127.0.0.1:") for p in published), "publish on loopback only"


@pytest.mark.parametrize(
    "args",
    [
        ["serve"],
        ["serve", "data", "--no-such-option"],
        ["serve", "data", "--uneven", "sideways"],
        ["serve", "data", "--port", "http"],
        ["nonexistent", "x"],
        ["pack", "only-src"],
        ["merge", "only-out"],
    ],
)
def test_the_checker_catches_wrong_commands(args):
    with pytest.raises((AssertionError, click.BadParameter)):
        check_cli(args)


def test_the_checker_catches_wrong_script_arguments():
    with pytest.raises(SystemExit):
        check_script(["python", "tools/train_image.py", "--remote", "http://x:1", "--bogus"])
    with pytest.raises(AssertionError):
        check_script(["python", "tools/no_such_script.py"])
    with pytest.raises(AssertionError, match="defines no"):
        check_script(["python", "-c", "import demo\ndemo.no_such_function()"])
