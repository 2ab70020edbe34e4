"""Command line: ``kvindex serve`` runs the service; score, explain, lookup, stats and instances query it;
``capture`` records the wire to an event log and ``replay`` rebuilds the index from one; ``route``
is the OpenAI-compatible routing proxy."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import structlog

from kvindex.capture.cli import add_capture, add_replay, add_serve_capture, serve_capture_config
from kvindex.config import NatsConfigError, NatsConnectError, NatsSettings, add_nats_arguments, parse_layered
from kvindex.config.args import (
    LOG_FORMAT_HELP,
    LOG_LEVEL_HELP,
    SUBJECT_PREFIX_HELP,
    PromptFileError,
    count,
    non_negative,
    parse_ids,
    port,
    port_or_off,
    positive,
    positive_number,
    quiet_broken_pipe,
    read_prompts,
)
from kvindex.config.nats import split_servers
from kvindex.observability.logs import configure_logging
from kvindex.route.admission_args import add_admission_options, admission_from_args
from kvindex.route.cli import add_route
from kvindex.security import add_client_options, add_server_options


def _add_serve(sub: Any) -> None:
    p = sub.add_parser("serve", help="run the index service")
    add_nats_arguments(
        p,
        default=None,
        url_help="NATS server URL(s), nats:// or tls://, repeated or comma-separated (a "
        "cluster: any is used and reconnected to); without one an embedded nats-server is started",
    )
    p.add_argument(
        "--embedded-nats-listen",
        default=None,
        type=_listen,
        metavar="HOST:PORT",
        help="where the embedded nats-server (no --nats) listens; default 127.0.0.1:0 (a free port, this "
        "machine only). 0.0.0.0:4222 lets workers on other machines connect (the log prints the URL they "
        "use); that server has no auth or TLS, so across machines an external nats-server is the "
        "deployable choice (docs/deploy.md)",
    )
    p.add_argument(
        "--grpc-host",
        default="0.0.0.0",
        help="address the gRPC API listens on: 0.0.0.0 (default) every interface, 127.0.0.1 this "
        "machine only",
    )
    p.add_argument("--grpc-port", type=port, default=50051, help="gRPC API port (0: any free port)")
    p.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    p.add_argument(
        "--metrics-port", type=port_or_off, default=9400, help="Prometheus /metrics port; -1 disables"
    )
    p.add_argument("--metrics-host", default="0.0.0.0", help="address /metrics listens on")
    p.add_argument("--log-format", choices=("auto", "json", "console"), default="auto", help=LOG_FORMAT_HELP)
    p.add_argument("--log-level", default="info", help=LOG_LEVEL_HELP)
    e = p.add_argument_group("Envoy ext_proc endpoint picker (docs/gateway.md)")
    e.add_argument(
        "--ext-proc-port", type=port_or_off, default=-1, help="serve the picker on this port; -1: off"
    )
    e.add_argument("--ext-proc-host", default="0.0.0.0", help="address the picker listens on")
    e.add_argument("--ext-proc-policy", default="", help="ranking policy for picks (default: ttft)")
    e.add_argument(
        "--ext-proc-pd",
        action="store_true",
        help="disaggregated prefill/decode: the destination is a decode instance, the prefill instance "
        "goes in x-prefiller-host-port (llm-d's disaggregation profile; docs/gateway.md)",
    )
    e.add_argument("--ext-proc-pd-min-input-tokens", type=int, default=2048, help="shorter: no prefiller")
    e.add_argument(
        "--ext-proc-pd-min-uncached-share",
        type=float,
        default=0.7,
        help="a lower uncached share on the decode pick: no prefiller",
    )
    e.add_argument(
        "--ext-proc-pd-transfer-ms-per-1k",
        type=float,
        default=2.0,
        help="KV transfer cost, ms per 1,000 tokens",
    )
    e.add_argument(
        "--ext-proc-pd-same-group", action="store_true", help="prefiller within the decode pick's --pd-group"
    )
    add_admission_options(e, named=True)
    _add_serve_routing(p)
    _add_serve_state(p)
    _add_serve_tokenize(p)

    add_server_options(p)
    _add_readiness_shutdown(p)


def _add_serve_tokenize(p: Any) -> None:
    """``kvindex serve``: text prompts' tokenizers and the bounds on tokenizing them."""
    t = p.add_argument_group("text prompts (docs/tokenize.md)")
    t.add_argument(
        "--tokenizer",
        action="append",
        default=[],
        metavar="MODEL=DIR",
        help="tokenize prompt/messages requests for MODEL with DIR's tokenizer.json, tokenizer_config.json "
        "and chat template (repeatable)",
    )
    t.add_argument(
        "--tokenize-cache-mb",
        type=non_negative,
        default=128.0,
        metavar="MIB",
        help="tokenization cache size",
    )
    t.add_argument(
        "--tokenize-call-mb",
        type=non_negative,
        default=16.0,
        metavar="MIB",
        help="the most one prompt adds to the tokenization cache (the rest of a longer one is encoded, "
        "not kept; default 16)",
    )
    t.add_argument(
        "--tokenize-max-chars",
        type=positive,
        default=8 << 20,
        metavar="N",
        help="prompt texts (and rendered chats) longer than N characters are refused: the bound on one "
        "tokenization's time and memory (default 8 Mi, some 2 M tokens)",
    )


def _add_serve_routing(p: Any) -> None:
    """``kvindex serve``: the in-process routing proxy, the pick, engines without KV events."""
    r = p.add_argument_group(
        "the OpenAI routing proxy in this process (kvindex route without the gRPC hop; "
        "kvindex/route/README.md). The admission flags above apply to it as well"
    )
    r.add_argument("--route-port", type=port_or_off, default=-1, help="serve the proxy on this port; -1: off")
    r.add_argument("--route-host", default="0.0.0.0", help="address the proxy listens on")
    r.add_argument("--route-top-k", type=int, default=3, help="instances ranked: the first, then retries")
    r.add_argument(
        "--route-connect-timeout", type=float, default=2.0, help="per engine connection attempt (s)"
    )
    k = p.add_argument_group("picking (docs/scoring.md#picking)")
    k.add_argument(
        "--pick",
        choices=("best", "softmax"),
        default="best",
        help="how Score and the ext_proc picker pick from the ranking when the request does not say: "
        "the policy's first choice, or a softmax over estimated TTFT",
    )
    k.add_argument(
        "--temperature",
        type=non_negative,
        default=0.05,
        help="softmax: the TTFT excess, in units of the request's own prefill, that costs a factor e "
        "in probability (0: best)",
    )
    k.add_argument(
        "--warmup",
        type=non_negative,
        default=0.0,
        metavar="SECONDS",
        help="a new instance's share of the requests it would get grows linearly over this long; 0: off",
    )
    k.add_argument(
        "--seed", type=int, default=0, help="seed of the picks' draws (and of randomised policies)"
    )
    k.add_argument(
        "--policy-option",
        action="append",
        default=[],
        type=parse_policy_option,
        metavar="POLICY.NAME=VALUE",
        help="override one parameter of a ranking policy (docs/scoring.md), e.g. ttft.replica_cost=2 "
        "or ttft.congestion=0; repeatable",
    )
    a = p.add_argument_group("engines without KV events (approximate mode, docs/scoring.md)")
    a.add_argument(
        "--instance",
        action="append",
        default=[],
        type=_static_instance,
        metavar="NAME=HOST:PORT",
        help="an instance that publishes nothing (repeatable); its cache is predicted from routing",
    )
    a.add_argument("--instance-model", default="", help="the model the --instance entries serve")
    a.add_argument("--instance-block-size", type=int, default=16, help="their KV block size (tokens)")
    a.add_argument("--instance-capacity", type=int, default=0, help="their GPU cache in blocks (0: 8192)")
    a.add_argument(
        "--predicted-ttl", type=float, default=120.0, help="seconds a routed prompt is assumed cached there"
    )


def _add_serve_state(p: Any) -> None:
    """``kvindex serve``: the prefill time model, self-healing, replicas, JetStream, limits."""
    c = p.add_argument_group("prefill time model (docs/scoring.md, Calibration)")
    c.add_argument(
        "--no-calibration",
        dest="calibration",
        action="store_false",
        help="rank every instance with the default prefill model: samples are counted, not learned from,"
        " and stored calibrations are neither loaded nor written",
    )
    c.add_argument(
        "--cost",
        action="append",
        default=[],
        type=parse_cost_option,
        metavar="NAME=VALUE",
        help="one parameter of the TTFT estimate, for engines unlike the default (a Llama-3-70B class "
        "model on 8 GPUs): prefill_a_ms, prefill_b_ms_per_token, prefill_c_ms_per_token2 (the prefill "
        "model before calibration), chunk_tokens, step_ms, decode_ms_per_seq (the engine's steps), "
        "kv_bytes_per_token, pcie_gbps, disk_gbps, network_gbps (loading KV from slower tiers); "
        "repeatable (docs/scoring.md)",
    )
    _add_serve_repair(p)
    rs = p.add_argument_group("replicas (docs/deploy.md#replicas)")
    # Not BooleanOptionalAction: KVINDEX_ROUTING_SYNC / `routing-sync = false` (kvindex/config) must
    # read as a switch, so the option takes an optional on/off value.
    rs.add_argument(
        "--routing-sync",
        nargs="?",
        const=True,
        default=None,
        type=_on_off,
        metavar="on|off",
        help="share routing state (in-flight ledger, speculative keys, prefix heat) with the other "
        "replicas on the same NATS and prefix; default: on with --nats, off with the embedded server",
    )
    rs.add_argument(
        "--no-routing-sync", dest="routing_sync", action="store_const", const=False, help="--routing-sync off"
    )
    rs.add_argument(
        "--replica-id",
        type=_replica_id,
        default="",
        help="this replica's name on {prefix}.routing.<id> ([A-Za-z0-9_-]{1,128}); default: hostname-pid",
    )
    sh = p.add_argument_group("index shards (docs/shards.md)")
    sh.add_argument(
        "--shard",
        type=_shard_spec,
        default=None,
        metavar="I/N",
        help="serve shard I of N: only the workers the nats-server maps to partition I (its config "
        "needs the mapping `kvindex shard-mappings N` prints); a --shards N front ranks over it",
    )
    sh.add_argument(
        "--shards",
        type=_shard_count,
        default=0,
        metavar="N",
        help="be the front of N shards: no events of its own; Score, Lookup and Release ask every "
        "shard (NATS request/reply) and rank over their answers",
    )
    sh.add_argument(
        "--shard-timeout",
        type=positive_number,
        default=0.5,
        help="a front's wait for each shard's answer (s); a shard that misses it is not ranked",
    )
    j = p.add_argument_group("JetStream (optional)")
    j.add_argument("--jetstream", action="store_true", help="keep event batches in a stream; rebuild from it")
    j.add_argument("--stream-max-age", type=float, default=3600.0, help="history kept in the stream (s)")
    j.add_argument("--stream-replicas", type=int, default=1, help="stream replicas in a NATS cluster (1-5)")
    _add_limits(p)
    add_serve_capture(p)


def _add_serve_repair(p: Any) -> None:
    """``kvindex serve``: self-healing (kvindex/repair/README.md)."""
    r = p.add_argument_group("self-healing")
    r.add_argument(
        "--reconcile-interval", type=float, default=60.0, help="periodic snapshot per instance (s); 0 off"
    )
    r.add_argument(
        "--reconcile-rate",
        type=float,
        default=8.0,
        help="at most this many periodic snapshots per second over the fleet (a large fleet's "
        "instances are then checked less often than --reconcile-interval); 0: no cap",
    )
    r.add_argument("--stale-after", type=float, default=5.0, help="no heartbeat this long: not ranked (s)")
    r.add_argument(
        "--forget-after", type=float, default=120.0, help="no heartbeat this long: blocks dropped (s)"
    )
    r.add_argument(
        "--max-concurrent-snapshots",
        type=int,
        default=16,  # RepairConfig.max_concurrent_snapshots (not imported: the CLI starts fast)
        help="snapshot requests in flight at once (turns)",
    )
    r.add_argument(
        "--replay-timeout", type=float, default=2.0, help="seconds to wait for a worker's replay answer"
    )
    r.add_argument(
        "--snapshot-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for a worker's snapshot (then retried)",
    )
    r.add_argument(
        "--snapshot-slot-hold",
        type=non_negative,
        default=1.0,
        help="a snapshot request not answered after this long gives its turn to the next (it goes on "
        "waiting for its answer until --snapshot-timeout), so that a worker that never answers "
        "does not make other workers' repairs wait (s)",
    )


def _shard_spec(text: str) -> Any:
    from kvindex.shards.layout import ShardSpec

    try:
        return ShardSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shard_count(text: str) -> int:
    from kvindex.shards.layout import MAX_SHARDS

    if not text.isdigit() or not 2 <= int(text) <= MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"expected a shard count 2..{MAX_SHARDS}, got {text!r}")
    return int(text)


def _shard_conflict(args: argparse.Namespace, nats: Any) -> str | None:
    """Why the shard flags cannot work together with the others (None: they can); ``nats``: the
    --nats servers (none: the embedded server)."""
    if args.shard is None and not args.shards:
        return None
    if args.shard is not None and args.shards:
        return "--shard and --shards: a process is a shard or a front, not both"
    flag = "--shard" if args.shard is not None else "--shards"
    if not nats:
        return (
            f"{flag} needs --nats: the nats-server's config partitions the workers (kvindex shard-mappings)"
        )
    if args.jetstream:
        return f"{flag} with --jetstream: shards read core NATS only"
    if args.shards and (args.capture or args.instance):
        return "--shards with --capture or --instance: a front consumes no events, keeps no instances"
    return None


def _listen(text: str) -> tuple[str, int]:
    from kvindex.api.listen import parse_listen

    try:
        return parse_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# The flags that set each listener's address (kvindex.api.listen.ListenError.what).
_LISTEN_FLAGS = {
    "gRPC": "--grpc-host/--grpc-port",
    "metrics": "--metrics-host/--metrics-port",
    "ext_proc": "--ext-proc-host/--ext-proc-port",
    "route": "--route-host/--route-port",
    "embedded NATS": "--embedded-nats-listen",
}


def _on_off(text: str) -> bool:
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")


def _replica_id(text: str) -> str:
    from kvindex.routing_sync.sync import check_replica_id

    try:
        return check_replica_id(text) if text else ""  # argparse converts the default "" too
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _static_instance(text: str) -> tuple[str, str]:
    from kvindex.wire.endpoint import BadEndpoint, check_endpoint
    from kvindex.wire.subjects import valid_worker_id

    name, sep, endpoint = text.partition("=")
    if not sep or not valid_worker_id(name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: want NAME=HOST:PORT, NAME matching [A-Za-z0-9_-]{{1,128}}"
        )
    try:
        return name, check_endpoint(endpoint)
    except BadEndpoint as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _tokenizer_dirs(specs: list[str]) -> dict[str, str]:
    dirs: dict[str, str] = {}
    for spec in specs:
        model, sep, directory = spec.partition("=")
        if not (sep and model and directory):
            raise SystemExit(f"--tokenizer {spec!r}: expected MODEL=DIR")
        if model in dirs:
            raise SystemExit(f"--tokenizer: model {model!r} given twice")
        dirs[model] = directory
    return dirs


def _add_readiness_shutdown(p: Any) -> None:
    g = p.add_argument_group("readiness and shutdown (docs/deploy.md)")
    g.add_argument(
        "--ready-window",
        type=float,
        default=1.0,
        help="first heartbeat window (s): instances heard in it must be in sync before ready",
    )
    g.add_argument(
        "--ready-grace",
        type=float,
        default=30.0,
        help="ready at the latest this long after start (s), even if some instances are still syncing",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=5.0,
        help="on SIGTERM/SIGINT/SIGHUP in-flight RPCs get this long (s); cleanup takes at most ~4 s more",
    )
    gc = p.add_argument_group("garbage collection (kvindex/service/gc_policy.py)")
    gc.add_argument(
        "--gc-freeze-every",
        type=non_negative,
        default=30.0,
        help="freeze the objects alive every this many s, so that collections skip the fleet's state; 0: off",
    )
    gc.add_argument(
        "--gc-full-every",
        type=positive_number,
        default=3600.0,
        help="a full collection of the frozen objects (cycles) every this many s: the one pause left "
        "(~1.4 s at 224,000 instances)",
    )


def _add_limits(p: Any) -> None:
    from kvindex.ingest.limits import DEFAULT_INGEST_LIMITS as defaults

    g = p.add_argument_group("limits", "bounds on what workers can make the index hold (docs/deploy.md)")
    for flag, kind, doc in (
        ("capacity-slack", float, "blocks per (instance, tier): announced capacity x this"),
        ("default-tier-blocks", int, "blocks per (instance, tier) when no capacity is announced"),
        ("max-tier-blocks", int, "blocks per (instance, tier), whatever capacity is announced"),
        ("max-instances-per-model", int, "instances of one model"),
        ("max-models", int, "models"),
        ("max-held-batches", int, "batches held per instance while it is repaired"),
        ("max-held-keys", int, "block keys in those held batches"),
        ("max-pending-repairs", int, "instances being repaired at once"),
    ):
        name = flag.replace("-", "_")
        default = getattr(defaults, name)
        g.add_argument(f"--{flag}", type=kind, default=default, help=f"{doc} (default {default})")


def _limits(args: argparse.Namespace) -> Any:
    from dataclasses import fields

    from kvindex.ingest.limits import IngestLimits

    return IngestLimits(**{f.name: getattr(args, f.name) for f in fields(IngestLimits)})


def _add_query(sub: Any, name: str, help_text: str, prompt: bool) -> None:
    p = sub.add_parser(name, help=help_text)
    p.add_argument("--server", default="127.0.0.1:50051", help="gRPC address of a running kvindex")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the answer")
    add_client_options(p)
    if prompt:
        p.add_argument("--model", required=True, help="the served model name the prompt is for")
        p.add_argument("--lora", default="", help="LoRA adapter name (default: the base model)")
        p.add_argument("--salt", default="", help="the engine's cache salt of the prompt, if any")
        g = p.add_mutually_exclusive_group(required=True)
        g.add_argument(
            "--tokens",
            help="token ids separated by commas and/or spaces, or @FILE: a JSON list of them or a prompt "
            'object {"model": ..., "token_ids": [...]} (what replay --query takes)',
        )
        g.add_argument(
            "--keys",
            "--block-keys",
            dest="keys",
            help="block keys separated by commas and/or spaces, or @FILE: a JSON list of them or a "
            'prompt object {"model": ..., "block_keys": [...]}',
        )
        g.add_argument("--prompt", help="a completions prompt as text, or @FILE (needs serve --tokenizer)")
        g.add_argument(
            "--messages", help="an OpenAI chat messages JSON list, or @FILE (needs serve --tokenizer)"
        )
        p.add_argument("--candidates", default="", help="comma-separated instance ids")
        if name in ("score", "explain"):
            p.add_argument(
                "--top-k", type=count, default=0, help="return at most this many instances (0: all)"
            )
        if name == "lookup":
            p.add_argument(
                "--max-instances", type=count, default=0, help="list at most this many, best first (0: all)"
            )
        if name == "explain":
            p.add_argument("--policy", default="", help="rank with this policy (default: the index's)")
            p.add_argument("--json", action="store_true", help="print the ExplainResponse as JSON")
            p.add_argument("--plain", action="store_true", help="plain text even on a terminal")
    elif name == "instances":
        p.add_argument("--model", default="", help="only this model's instances (default: all)")
        p.add_argument(
            "--brief", action="store_true", help="identity and routing fields only (ListInstances view brief)"
        )


class UsageError(ValueError):
    """A command line value that cannot be sent: reported on one line, exit code 2."""


_ID_FLAGS = {"--tokens": "token_ids", "--keys": "block_keys"}


def _read_arg_file(flag: str, spec: str) -> str:
    path = spec[1:]
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise UsageError(f"{flag} {spec}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{flag} {spec}: cannot read it ({exc})") from None


def _int_list(flag: str, spec: str, args: argparse.Namespace) -> list[int]:
    """``--tokens``/``--keys``: ids separated by commas and/or whitespace, or ``@FILE`` holding a
    prompt (kvindex.config.args.read_prompts: a JSON list of ids, or an object as replay --query
    takes), each id checked against the field's range (a value protobuf would refuse is reported
    here, naming the value, instead of a traceback)."""
    field = _ID_FLAGS[flag]
    if not spec.startswith("@"):
        try:
            return parse_ids(spec, field)
        except ValueError as exc:
            raise UsageError(f"{flag}: {exc}") from None
    try:
        prompts = read_prompts(spec[1:])
    except PromptFileError as exc:
        raise UsageError(f"{flag} @{exc}") from None
    if len(prompts) != 1:
        raise UsageError(f"{flag} {spec}: holds {len(prompts)} prompts; {flag} takes one")
    prompt = prompts[0]
    if field not in prompt:
        other = next((f for f, name in _ID_FLAGS.items() if name in prompt and f != flag), None)
        hint = f" (it has {_ID_FLAGS[other]}: {other} {spec})" if other else ""
        raise UsageError(f"{flag} {spec}: no {field} in it{hint}")
    # The model, LoRA and salt decide the block keys: a prompt file made for others is a mistake.
    for name in ("model", "lora", "salt"):
        if name in prompt and prompt[name] != getattr(args, name):
            raise UsageError(
                f"{flag} {spec} is a prompt for {name} {prompt[name]!r}, not --{name} {getattr(args, name)!r}"
            )
    ignored = sorted(set(prompt) - {field, "model", "lora", "salt"})
    if ignored:
        print(
            f"kvindex {args.command}: note: {flag} {spec}: {', '.join(ignored)} ignored (the flags set "
            "them here; replay --query reads them)",
            file=sys.stderr,
        )
    return prompt[field]


def _text(flag: str, spec: str) -> str:
    return _read_arg_file(flag, spec) if spec.startswith("@") else spec


def _prompt_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"model": args.model, "lora": args.lora, "salt": args.salt}
    if args.tokens is not None:
        fields["token_ids"] = _int_list("--tokens", args.tokens, args)
    elif args.keys is not None:
        fields["block_keys"] = _int_list("--keys", args.keys, args)
    elif args.prompt is not None:
        fields["prompt"] = _text("--prompt", args.prompt)
    else:
        fields["messages"] = _text("--messages", args.messages)
    if args.candidates:
        fields["candidates"] = [c for c in args.candidates.split(",") if c]
    return fields


def _list_instances(stub: Any, model: str, timeout: float, view: str = "brief") -> Any:
    """Every instance (of ``model``) in one ListInstancesResponse, asked page by page (a large
    fleet's one answer would pass gRPC's 4 MB default; kvindex/api/listing.py)."""
    from kvindex.client.aio import LIST_PAGE
    from kvindex.v1 import kvindex_pb2 as pb

    out, token = pb.ListInstancesResponse(), ""
    while True:
        request = pb.ListInstancesRequest(model=model, view=view, page_size=LIST_PAGE, page_token=token)
        reply = stub.ListInstances(request, timeout=timeout)
        out.instances.extend(reply.instances)
        token = reply.next_page_token
        if not token:
            return out


def _unknown_model(stub: Any, model: str, timeout: float) -> str:
    """The message for a model no instance of which the index knows (it answers such a query with
    an empty ranking, which reads like "nothing cached" when it means "nothing there")."""
    listed = _list_instances(stub, "", timeout)
    known = sorted({i.model for i in listed.instances if i.model})
    return f"no instance of model {model!r} is known to the index (it knows: {', '.join(known) or 'none'})"


def _unknown_candidates(stub: Any, model: str, candidates: list[str], timeout: float) -> str:
    """What is wrong with candidates naming no instance of ``model`` ("" when each names one).

    The API restricts a ranking to the candidates it knows and ignores the others (a router's list
    may lag the index's by a heartbeat); on the command line an unknown one is a typo or a stale
    id, and an empty ranking would read as "nothing cached there"."""
    listed = _list_instances(stub, model, timeout).instances
    ids = {i.instance_id for i in listed}
    workers = {i.worker for i in listed}
    unknown = [c for c in candidates if c not in (ids if "/" in c else workers)]
    if not unknown:
        return ""
    known = sorted(ids)
    shown = ", ".join(known[:10]) + (f" and {len(known) - 10} more" if len(known) > 10 else "")
    names = ", ".join(repr(c) for c in unknown)
    return (
        f"no instance {names} of model {model!r} is known to the index (it knows: {shown or 'none'})"
        if len(unknown) == 1
        else f"no instances {names} of model {model!r} are known to the index (it knows: {shown or 'none'})"
    )


def _query(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf.json_format import MessageToDict

    from kvindex.security import ClientTLS, SecurityConfigError, open_channel, token_from_args
    from kvindex.v1 import kvindex_pb2 as pb
    from kvindex.v1 import kvindex_pb2_grpc as pb_grpc

    fields: dict[str, Any] = {}
    try:
        if args.command in ("score", "lookup", "explain"):
            fields = _prompt_fields(args)
    except UsageError as exc:
        print(f"kvindex {args.command}: error: {exc}", file=sys.stderr)
        return 2
    try:
        channel = open_channel(args.server, ClientTLS.from_args(args), token_from_args(args))
    except SecurityConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.KvIndexStub(channel)
        try:
            if args.command in ("score", "lookup", "explain"):
                if args.command == "score":
                    reply = stub.Score(pb.ScoreRequest(top_k=args.top_k, **fields), timeout=args.timeout)
                elif args.command == "explain":
                    request = pb.ScoreRequest(top_k=args.top_k, policy=args.policy, **fields)
                    reply = stub.Explain(request, timeout=args.timeout)
                else:
                    request = pb.LookupRequest(max_instances=args.max_instances, **fields)
                    reply = stub.Lookup(request, timeout=args.timeout)
                ranking = reply.ranking if args.command == "explain" else reply
                if not ranking.block_size:  # the index answers an unknown model with no block size
                    unknown = _unknown_model(stub, args.model, args.timeout)
                    if args.command != "lookup" or ("prompt" not in fields and "messages" not in fields):
                        print(f"kvindex {args.command}: error: {unknown}", file=sys.stderr)
                        return 2
                    # A text lookup still answers how the index tokenizes it: shown, with the note.
                    print(f"kvindex lookup: note: {unknown}; nothing can match", file=sys.stderr)
                elif "candidates" in fields:
                    unknown = _unknown_candidates(stub, args.model, fields["candidates"], args.timeout)
                    if unknown:
                        print(f"kvindex {args.command}: error: --candidates: {unknown}", file=sys.stderr)
                        return 2
            elif args.command == "stats":
                reply = stub.Stats(pb.StatsRequest(), timeout=args.timeout)
            else:
                view = "brief" if args.brief else "full"
                reply = _list_instances(stub, args.model, args.timeout, view)
        except grpc.RpcError as exc:
            if args.command == "explain" and exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                # What the flags asked for makes no sense (an unknown --policy, a text prompt the
                # index cannot tokenize): said as a usage error.
                print(f"kvindex explain: error: {exc.details()}", file=sys.stderr)
                return 2
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    if args.command == "explain" and not args.json:
        from kvindex.capture.cli import Output, print_explanation

        r = reply.ranking
        title = (
            f"model {r.model!r}: {r.prompt_tokens} prompt tokens, {r.total_blocks} blocks of {r.block_size}, "
            f"policy {r.policy} (cost in {r.cost_unit}), pick {r.pick}"
        )
        print_explanation(Output(plain=args.plain), reply, title)
        return 0
    print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
    return 0


def _ext_proc_pd(args: argparse.Namespace) -> Any:
    """The picker's PdConfig (None without --ext-proc-pd); SystemExit naming a bad value."""
    if not args.ext_proc_pd:
        return None
    from kvindex.route.pd import PdConfig

    try:
        return PdConfig(
            min_input_tokens=args.ext_proc_pd_min_input_tokens,
            min_uncached_share=args.ext_proc_pd_min_uncached_share,
            transfer_ms_per_1k=args.ext_proc_pd_transfer_ms_per_1k,
            measure=False,
            same_group=args.ext_proc_pd_same_group,
        )
    except ValueError as exc:
        raise SystemExit(f"kvindex serve: error: --ext-proc-pd: {exc}") from None


def _embedded_route(args: argparse.Namespace, admission: Any, objectives: Any) -> Any:
    """The RouteConfig of ``--route-port`` (None: off); SystemExit when aiohttp is missing."""
    if args.route_port < 0:
        return None
    if args.route_top_k < 1:
        raise SystemExit("kvindex serve: error: --route-top-k must be at least 1")
    try:
        from kvindex.route.proxy import RouteConfig
    except ImportError as exc:
        raise SystemExit(
            f"kvindex serve: error: --route-port needs {exc.name}, which is not installed: "
            "pip install 'kvindex[route]'"
        ) from None
    return RouteConfig(
        index="in-process",
        host=args.route_host,
        port=args.route_port,
        top_k=args.route_top_k,
        connect_timeout=args.route_connect_timeout,
        grace=args.shutdown_grace,
        admission=admission,
        objectives=objectives,
    )


def _serve(args: argparse.Namespace) -> int:
    from kvindex.lifecycle import Stop, run
    from kvindex.scoring.costs import cost_config
    from kvindex.service.app import CLEANUP_BUDGET, IndexService, serve_until_stopped

    try:  # checked first: a wrong flag is one line, before logging is set up or anything starts
        costs = cost_config(dict(args.cost), calibrate=args.calibration)
    except ValueError as exc:
        print(f"kvindex serve: error: argument --cost: {exc}", file=sys.stderr)
        return 2
    conflict = _shard_conflict(args, split_servers(args.nats))
    if conflict is not None:
        print(f"kvindex serve: error: {conflict}", file=sys.stderr)
        return 2
    configure_logging(args.log_format, args.log_level)
    from kvindex.service.malloc import reuse_large_allocations

    reuse_large_allocations()  # long prompts: a call's MiB reused, not faulted in anew (its module says)
    try:
        nats = NatsSettings.from_args(args)  # None: embedded nats-server
    except NatsConfigError as exc:
        structlog.get_logger("kvindex").error("nats_connect_failed", error=str(exc))
        return 2
    try:
        admission, objectives = admission_from_args(args)
    except ValueError as exc:
        structlog.get_logger("kvindex").error("bad_admission_option", error=str(exc))
        return 2
    if nats is not None and args.embedded_nats_listen is not None:
        print(
            "kvindex serve: error: --embedded-nats-listen is for the embedded server; not with --nats",
            file=sys.stderr,
        )
        return 2
    config = _service_config(args, nats, costs, admission, objectives)
    if args.instance and not args.instance_model:
        raise SystemExit("kvindex serve: --instance needs --instance-model (the model they serve)")
    from kvindex.tokenize import TokenizeError

    try:
        service = IndexService(config)
    except TokenizeError as exc:
        print(f"kvindex serve: {exc}", file=sys.stderr)
        return 2

    def start_failed(exc: Exception) -> int | None:
        """A start error the user can fix, logged before the stop's own lines; exit code 2."""
        from kvindex.api.listen import ListenError

        if isinstance(exc, (NatsConfigError, NatsConnectError)):
            structlog.get_logger("kvindex").error("nats_connect_failed", error=str(exc))
            return 2
        if isinstance(exc, ListenError):
            flag = _LISTEN_FLAGS.get(exc.what, "")
            structlog.get_logger("kvindex").error(
                "listen_failed", error=f"{exc} (choose another with {flag})"
            )
            return 2
        return None

    async def main(stop: Stop) -> int:
        return await serve_until_stopped(service, stop, start_failed)

    # SIGTERM/SIGINT/SIGHUP or the parent's exit stop it within the grace (docs/deploy.md).
    return run(main, grace=config.shutdown_grace + CLEANUP_BUDGET, name="kvindex-serve")


def _service_config(args: argparse.Namespace, nats: Any, costs: Any, admission: Any, objectives: Any) -> Any:
    """``kvindex serve``'s ServiceConfig from its flags (``nats``: the NatsSettings, None for the
    embedded server; ``costs``, ``admission``, ``objectives``: the flags already checked)."""
    from kvindex.fleet.liveness import LivenessConfig
    from kvindex.ingest.nats_source import JetStreamConfig
    from kvindex.repair.nats_repair import RepairConfig
    from kvindex.routing_sync.sync import SyncConfig
    from kvindex.scoring.ranker import RankerConfig
    from kvindex.security import ServerSecurity
    from kvindex.service.app import ServiceConfig
    from kvindex.service.gc_policy import GcConfig
    from kvindex.service.readiness import ReadinessConfig

    nats_host, nats_port = args.embedded_nats_listen or ("127.0.0.1", 0)
    return ServiceConfig(
        nats_url=nats,
        embedded_nats_host=nats_host,
        embedded_nats_port=nats_port,
        grpc_host=args.grpc_host,
        grpc_port=args.grpc_port,
        subject_prefix=args.subject_prefix,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        metrics_host=args.metrics_host,
        repair=RepairConfig(
            reconcile_interval=args.reconcile_interval,
            reconcile_rate=args.reconcile_rate,
            max_concurrent_snapshots=args.max_concurrent_snapshots,
            replay_timeout=args.replay_timeout,
            snapshot_timeout=args.snapshot_timeout,
            snapshot_slot_hold=args.snapshot_slot_hold,
        ),
        liveness=LivenessConfig(stale_after=args.stale_after, forget_after=args.forget_after),
        jetstream=JetStreamConfig(max_age=args.stream_max_age, replicas=args.stream_replicas)
        if args.jetstream
        else None,
        capture=serve_capture_config(args),
        grpc_security=ServerSecurity.from_args(args),
        ext_proc_port=None if args.ext_proc_port < 0 else args.ext_proc_port,
        ext_proc_host=args.ext_proc_host,
        ext_proc_policy=args.ext_proc_policy,
        ext_proc_pd=_ext_proc_pd(args),
        ext_proc_admission=admission,
        ext_proc_objectives=objectives,
        route=_embedded_route(args, admission, objectives),
        routing_sync=SyncConfig(enabled=args.routing_sync, replica_id=args.replica_id),
        shard=args.shard,
        shards=args.shards,
        shard_timeout=args.shard_timeout,
        static_instances=args.instance,
        static_model=args.instance_model,
        static_block_size=args.instance_block_size,
        static_capacity=args.instance_capacity,
        policy_options=check_policy_options(args.policy_option),
        ranker=RankerConfig(
            predicted_ttl=args.predicted_ttl,
            costs=costs,
            seed=args.seed,
            pick=args.pick,
            temperature=args.temperature if args.pick == "softmax" else 0.0,
            warmup=args.warmup,
        ),
        tokenizers=_tokenizer_dirs(args.tokenizer),
        tokenize_cache_bytes=int(args.tokenize_cache_mb * (1 << 20)),
        tokenize_call_bytes=int(args.tokenize_call_mb * (1 << 20)),
        tokenize_max_chars=args.tokenize_max_chars,
        limits=_limits(args),
        readiness=ReadinessConfig(window=args.ready_window, grace=args.ready_grace),
        shutdown_grace=args.shutdown_grace,
        gc=GcConfig(
            enabled=args.gc_freeze_every > 0,
            freeze_every=args.gc_freeze_every or 30.0,
            full_every=args.gc_full_every,
        ),
    )


def parse_cost_option(text: str) -> tuple[str, float]:
    """``NAME=VALUE`` -> (name, value); names and ranges are checked by ``cost_config``."""
    name, eq, raw = text.partition("=")
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not eq or not name.strip() or math.isnan(value):
        raise argparse.ArgumentTypeError(f"expected NAME=NUMBER (e.g. step_ms=6.1), got {text!r}")
    return name.strip(), value


def parse_policy_option(text: str) -> tuple[str, str, Any]:
    """``POLICY.NAME=VALUE`` -> (policy, parameter, value); the value as a number or a boolean when
    it reads as one. Unknown policies and parameters are refused when the options are checked."""
    key, eq, raw = text.partition("=")
    policy, dot, name = key.strip().partition(".")
    if not eq or not dot or not policy or not name.isidentifier():
        raise argparse.ArgumentTypeError(
            f"expected POLICY.NAME=VALUE (e.g. ttft.replica_cost=2), got {text!r}"
        )
    value: Any = raw.strip()
    low = value.lower()
    if low in ("true", "false"):
        value = low == "true"
    else:
        for kind in (int, float):
            try:
                value = kind(value)
                break
            except ValueError:
                continue
    return policy, name, value


def check_policy_options(options: list[tuple[str, str, Any]]) -> dict[str, dict[str, Any]]:
    """The options by policy, checked against the policies' own parameters (a typo must not be
    ignored silently)."""
    import inspect

    from kvindex.scoring.policies import POLICY_CLASSES

    out: dict[str, dict[str, Any]] = {}
    for policy, name, value in options:
        cls = POLICY_CLASSES.get(policy)
        if cls is None:
            raise SystemExit(
                f"--policy-option: unknown policy {policy!r} (one of {', '.join(POLICY_CLASSES)})"
            )
        params = [p for p in inspect.signature(cls).parameters if p != "self"]
        if name not in params:
            raise SystemExit(
                f"--policy-option: {policy} has no parameter {name!r} (it has: {', '.join(params) or 'none'})"
            )
        out.setdefault(policy, {})[name] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    """Every ``kvindex`` command (also what tests check deployment files against)."""
    parser = argparse.ArgumentParser(prog="kvindex", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_query(sub, "score", "rank instances for a prompt", prompt=True)
    _add_query(sub, "explain", "why a prompt would go where it would: the ranking term by term", prompt=True)
    _add_query(sub, "lookup", "per-instance, per-tier matched blocks for a prompt", prompt=True)
    _add_query(sub, "stats", "index size and ingest counters", prompt=False)
    _add_query(sub, "instances", "list known instances", prompt=False)
    add_capture(sub)
    add_replay(sub)
    add_route(sub)
    m = sub.add_parser(
        "shard-mappings", help="print the nats-server config block that partitions workers into N shards"
    )
    m.add_argument("shards", type=_shard_count, metavar="N", help="how many shards")
    m.add_argument("--subject-prefix", default="kvindex", help=SUBJECT_PREFIX_HELP)
    return parser


def _glue_negative_lists(argv: list[str]) -> list[str]:
    """``--tokens -1,2``: argparse takes ``-1,2`` for an option and says only "expected one
    argument"; glued as ``--tokens=-1,2`` the value reaches the range check, which says why not."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in _ID_FLAGS and i + 1 < len(argv) and re.fullmatch(r"-\d[\d, -]*", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


@quiet_broken_pipe
def main(argv: list[str] | None = None) -> int:
    argv = _glue_negative_lists(sys.argv[1:] if argv is None else list(argv))
    args = parse_layered(build_parser(), argv)  # command line, then KVINDEX_* environment, then --config TOML
    if args.command == "serve":
        return _serve(args)
    if args.command == "capture":
        from kvindex.capture.cli import run_capture

        return run_capture(args)
    if args.command == "route":
        from kvindex.route.cli import run_route

        return run_route(args)
    if args.command == "replay":
        from kvindex.capture.cli import run_replay

        return run_replay(args)
    if args.command == "shard-mappings":
        from kvindex.shards.layout import nats_mappings
        from kvindex.wire.subjects import Subjects

        try:
            subjects = Subjects(args.subject_prefix)
        except ValueError as exc:
            print(f"kvindex shard-mappings: error: argument --subject-prefix: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(nats_mappings(subjects, args.shards))
        return 0
    return _query(args)


if __name__ == "__main__":
    sys.exit(main())
