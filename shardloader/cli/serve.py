"""``shardloader serve PIPELINE``: run a dataset's pipeline here and stream batches to trainers.

PIPELINE is either ``package.module:factory`` (imported from this machine's own code, called
without arguments, returning a configured :class:`ShardedDataset`) or a dataset path/URL that
the options below configure (:mod:`shardloader.service.pipeline`).  Nothing a client sends is
ever run.  Imports of the library happen inside the command, so ``--help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from typing import Any

import click

from shardloader.cli.group import main
from shardloader.cli.options import DATASET_FLAGS, dataset_options, dataset_preset, parse_pairs
from shardloader.errors import UsageError
from shardloader.presets import IMAGE_DECODES

SERVE_DATASET_FLAGS = (*DATASET_FLAGS, "uneven", "decode", "fill", "require")

__all__ = ["serve"]


@main.command()
@click.argument("pipeline")
@click.option(
    "--host",
    default="127.0.0.1",
    help="Address to listen on; any non-loopback address needs --token-file.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8470,
    help="Port to listen on; 0 picks a free one (see --port-file).",
)
@click.option(
    "--port-file", type=click.Path(dir_okay=False), help="Write the bound port here once listening."
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False),
    help="Private file (mode 0600) holding the bearer token every request but /health must "
    "carry; without one, any local user can read the batches.",
)
@click.option(
    "--workers",
    type=click.IntRange(0),
    default=2,
    help="DataLoader worker processes per stream.",
)
@click.option(
    "--max-inflight",
    type=click.IntRange(1),
    default=4,
    help="Finished batches buffered per stream (backpressure).",
)
@click.option(
    "--max-clients",
    type=click.IntRange(1),
    default=8,
    help="Concurrent streams; more are answered 503 with Retry-After.",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=10.0,
    help="Seconds a new connection has to send its whole request head; then it is closed.",
)
@click.option(
    "--idle-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    help="Seconds a connection may wait between requests.",
)
@click.option(
    "--write-timeout",
    type=click.FloatRange(min=0, min_open=True),
    default=30.0,
    help="Seconds a client may read nothing of a response; then its stream (and its "
    "--max-clients slot) ends and the client resumes on a new connection.",
)
@dataset_options(batch_size=None, transform="auto")
@click.option(
    "--uneven",
    type=click.Choice(["pad", "drop"]),
    default="pad",
    help="Even out the ranks' steps by repeating samples, or by dropping them.",
)
@click.option(
    "--decode",
    type=click.Choice(IMAGE_DECODES),
    default="tensor",
    help="How image fields decode without a --transform.",
)
@click.option(
    "--fill",
    multiple=True,
    metavar="FIELD=VALUE",
    help="What a sample lacking FIELD (or holding null) gets, e.g. --fill txt= for an empty "
    "caption (VALUE parsed as JSON if it can be; repeatable).",
)
@click.option(
    "--require",
    multiple=True,
    metavar="FIELD",
    help="Skip samples lacking FIELD (or holding null), logging their keys; the dataset then "
    "skips other bad samples too (on_error='skip'; repeatable).",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
)
@click.pass_context
def serve(
    ctx: click.Context,
    pipeline: str,
    host: str,
    port: int,
    port_file: str | None,
    token_file: str | None,
    log_level: str,
    **flags: Any,
) -> None:
    """Serve PIPELINE's batches to RemoteLoader clients (GET /v1/batches, /v1/info, /metrics,
    /health).

    PIPELINE: `package.module:factory` returning a configured ShardedDataset, or a dataset
    path/URL configured by the dataset options (as `shardloader bench` reads it).  Binds
    127.0.0.1 unless --host says otherwise; then --token-file is required and every request but
    /health is authenticated.
    """
    from shardloader.service.options import ServeOptions
    from shardloader.service.pipeline import declared_options, is_factory, load_pipeline, read_token
    from shardloader.service.server import serve as run_server

    token = read_token(token_file) if token_file else None
    if port_file and not os.path.isdir(os.path.dirname(os.path.abspath(port_file))):
        raise UsageError(f"--port-file {port_file}: its folder does not exist")
    options = ServeOptions(  # the stream flags are ServeOptions' fields by name
        token=token,
        **{f.name: flags.pop(f.name) for f in dataclasses.fields(ServeOptions) if f.name in flags},
    )
    preset = None
    if is_factory(pipeline):
        given = [
            f"--{name.replace('_', '-')}"
            for name in SERVE_DATASET_FLAGS
            if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT
        ]
        if given:
            raise UsageError(
                f"{', '.join(given)} configure a dataset path; the factory "
                f"{pipeline} configures its own dataset"
            )
    else:
        preset = dataset_preset(
            flags,
            uneven=flags.pop("uneven"),
            decode=flags.pop("decode"),
            fill=parse_pairs(
                flags.pop("fill"),
                "--fill",
                "FIELD=VALUE, e.g. --fill txt= (an empty caption) or --fill cls=-1",
            ),
            required=tuple(flags.pop("require")),
        )
    logging.basicConfig(
        level=log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    dataset = load_pipeline(pipeline, preset)

    def ready(bound_host: str, bound_port: int) -> None:
        if port_file:
            tmp = f"{port_file}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(f"{bound_port}\n")
            os.replace(tmp, port_file)
        shown = f"[{bound_host}]" if ":" in bound_host else bound_host
        click.echo(
            f"serving {pipeline} on http://{shown}:{bound_port} "
            f"({dataset.manifest.num_samples} samples, {options.workers} workers per stream)"
        )
        sys.stdout.flush()

    run_server(
        dataset,
        options,
        host=host,
        port=port,
        on_ready=ready,
        log_level="warning" if log_level == "info" else log_level,
        declared=declared_options(pipeline, preset),
    )
