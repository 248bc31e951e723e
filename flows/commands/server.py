"""`moe-pipeline stack|pools|recovery|deployments|alerts`: the local stack, and what a Prefect
server (yours, the stack's or Prefect Cloud) needs beyond prefect.yaml."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from flows.commands import EXIT_CONFIG
from moe.errors import InputError
from tasks.config import load_config

Handler = Callable[[argparse.Namespace], int]


def _stack_errors(fn: Handler) -> Handler:
    """A StackError (something the user can fix) is its message on stderr and exit 1."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        from flows.stack_processes import StackError

        try:
            return fn(args)
        except StackError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1

    return run


@_stack_errors
def stack_up(args: argparse.Namespace) -> int:
    from flows import stack

    stack.up(args.root, args.params, ui=not args.no_ui)
    return 0


@_stack_errors
def stack_status(args: argparse.Namespace) -> int:
    import json

    from flows import stack

    print(json.dumps(stack.status(args.root), indent=1))
    return 0


@_stack_errors
def stack_down(args: argparse.Namespace) -> int:
    from flows import stack

    if not stack.down(args.root):
        print("nothing of the stack was running")
    return 0


@_stack_errors
def stack_watch(args: argparse.Namespace) -> int:
    from flows import stack

    stack.watch(args.root)
    return 0


@_stack_errors
def stack_run(args: argparse.Namespace) -> int:
    from flows import stack
    from flows.stack_processes import STATE_DIR

    result = stack.run(args.root, args.params, args.overrides, args.stages, args.handoff)
    work = args.root.resolve() / STATE_DIR / "work"
    print(f"pipeline {result['state']}: {result['message'] or ''}".rstrip(": "))
    print(f"working folders of the pools (outputs, reports, checkpoints): {work}/<pool>")
    return 0 if result["completed"] else 1


def pools_template(args: argparse.Namespace) -> int:
    """`pools template`: one pool's job template, as JSON."""
    import json

    from flows.pools import job_template

    cfg = load_config(args.params, args.overrides)
    if args.pool not in cfg.pools.definitions:
        raise InputError(
            f"pool {args.pool!r} is not in pools.definitions "
            f"({', '.join(sorted(cfg.pools.definitions))})"
        )
    print(json.dumps(job_template(cfg, args.pool, args.type, args.image_tag), indent=2))
    return 0


def pools_create(args: argparse.Namespace) -> int:
    """`pools create`: every pool of pools.definitions on the server of PREFECT_API_URL."""
    from prefect.client.orchestration import get_client

    from flows.pools import create

    cfg = load_config(args.params, args.overrides)
    with get_client(sync_client=True) as client:
        for pool in create(client, cfg, args.type, args.image_tag):
            spec = cfg.pools.definitions[pool]
            print(
                f"pool {pool} ({args.type}): {spec.gpus} GPU(s) {spec.gpu_product or ''}, "
                f"{spec.cpu:g} CPU, {spec.memory_gib} GiB, on {client.api_url}"
            )
    return 0


def recovery_install(args: argparse.Namespace) -> int:
    """`recovery install`: the two automations of flows/recovery.py on this server."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from flows.recovery import install

    cfg = load_config(args.params, args.overrides)
    with get_client(sync_client=True) as client:
        try:
            names = install(client, cfg.recovery)
        except ObjectNotFound:
            print(
                f"error: no deployment recover/recover on {client.api_url}: deploy prefect.yaml "
                "first (prefect deploy --all)",
                file=sys.stderr,
            )
            return 1
        where = client.api_url
    if not names:
        print(f"recovery.enabled is false: the automations were removed from {where}")
    for name in names:
        print(f"automation {name!r} on {where}")
    r = cfg.recovery
    print(
        f"workers must send flow-run heartbeats: PREFECT_FLOWS_HEARTBEAT_FREQUENCY={r.heartbeat_s} "
        f"in each worker's environment (a run is crashed after {r.crashed_after_s} s without one)"
    )
    return 0


def deployments_configure(args: argparse.Namespace) -> int:
    """`deployments configure`: the run forms' defaults on this server."""
    from prefect.client.orchestration import get_client

    from flows.deployments import set_form_defaults

    cfg = load_config(args.params, args.overrides)
    with get_client(sync_client=True) as client:
        changed = set_form_defaults(client, cfg)
        where = client.api_url
    if not changed:
        print(f"error: no deployment of prefect.yaml on {where}: run `prefect deploy --all` first")
        return 1
    print(f"run form defaults set on {where}: {', '.join(changed)}")
    return 0


def alerts_install(args: argparse.Namespace) -> int:
    """`alerts install`: the automation of flows/deployments.py, to an existing block."""
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    from flows.deployments import install_alert
    from tasks.events import BUDGET_ALERT, EVENTS

    events = tuple(args.events or [BUDGET_ALERT])
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        print(
            f"error: unknown event(s) {unknown}; the events are {', '.join(EVENTS)}",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    if "/" not in args.block:
        print(
            f"error: --block {args.block!r} must be TYPE/NAME, e.g. slack-webhook/moe-alerts",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    try:
        block = Block.load(args.block)
    except ValueError as e:
        print(f"error: no notification block {args.block}: {e}", file=sys.stderr)
        return EXIT_CONFIG
    with get_client(sync_client=True) as client:
        name = install_alert(client, block._block_document_id, events)
        where = client.api_url
    print(f"automation {name!r} on {where}: {', '.join(events)} -> {args.block}")
    return 0
