"""`ddiloco status`: a live view of a running job, from its synchronizer's GET /v1/status.

    DDILOCO_TOKEN=s3cret ddiloco status http://127.0.0.1:8470          # refreshes every 2 s
    ddiloco status https://sync:8470 --token-file token --ca ca.crt --once
    ddiloco status http://127.0.0.1:8470 --json | jq .goodput          # the raw status, once
    ddiloco status --job my-job -n team-a [--context prod]             # through the Kubernetes API
    ddiloco status http://h:8470,http://h:8471                         # a sharded synchronizer

It shows fragments and versions; learners with state, step, tokens/s and share of the merged
work; goodput, merged-work ratio and refusals (cli/statusview.py, the same view as `ddiloco
local`'s live table). The token comes from `--token-file` (its first line) or DDILOCO_TOKEN,
never from a flag (it would show in `ps`). An https URL is verified against `--ca` (else the
system trust store); `--client-cert` + `--client-key` present a client certificate to a
synchronizer that requires mutual TLS. A comma list of URLs is a sharded synchronizer's
shards (synchronizer/shards.py): the view is their statuses merged (`merge_statuses`), and a
shard that cannot be reached fails the answer as one synchronizer would.

`--job` reads the DecoupledDiLoCoJob with your kubeconfig, the bearer token from the job's
token Secret, and the synchronizer's status through a port-forward to its pod (cli/
status_k8s.py says why not the apiserver's service proxy). Where that is refused (no RBAC for
Secrets or pods/portforward, no Running pod, mutual TLS without a client certificate) it
shows the job's own status (what the operator last read from the synchronizer) and says so in
one line.

Exit codes (cli/errors.py): 0 shown; 2 a bad argument, a token the synchronizer refuses, a job
that does not exist, a certificate that is not trusted; 1 a synchronizer or apiserver that
cannot be reached. In the live view a later failure is shown in the title and retried.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.cli.errors import RuntimeFailure, UsageError, one_line, usage_errors

PROG = "ddiloco status"


@dataclass(frozen=True)
class Snapshot:
    """One answer: the raw JSON as served, and where it came from."""

    raw: dict[str, Any]
    source: str
    note: str = ""
    """Set when this is not the synchronizer's own status (the job's CR status instead)."""
    is_job_status: bool = False


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=PROG, description="Show a running job's status.")
    ap.add_argument("url", nargs="?", help="synchronizer base URL, http:// (h2c) or https://")
    ap.add_argument("--job", help="a DecoupledDiLoCoJob: read it through the Kubernetes API")
    ap.add_argument("-n", "--namespace", help="the job's namespace (default: the context's)")
    ap.add_argument("--context", help="kubeconfig context (default: the current one)")
    ap.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, ~/.kube/config)")
    ap.add_argument("--token-file", help="file whose first line is the job token (else env)")
    ap.add_argument("--ca", help="PEM CA that signed an https synchronizer's certificate")
    ap.add_argument("--client-cert", help="PEM client certificate (mutual TLS)")
    ap.add_argument("--client-key", help="PEM key of --client-cert")
    ap.add_argument("--once", action="store_true", help="print the tables once and exit")
    ap.add_argument("--json", action="store_true", help="print the raw status JSON once and exit")
    ap.add_argument(
        "--interval", type=float, default=2.0, help="seconds between refreshes (default 2)"
    )
    ap.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default 5)"
    )
    args = ap.parse_args(argv)
    if (args.url is None) == (args.job is None):
        ap.error("give a synchronizer URL or --job NAME (one of them)")
    for url in args.url.split(",") if args.url is not None else []:  # a shard list too
        if not url.strip().lower().startswith(("http://", "https://")):
            ap.error(f"URL must start with http:// or https://, got {url.strip()!r}")
    if not args.interval > 0 or not args.timeout > 0:
        ap.error("--interval and --timeout must be > 0")
    if (args.client_cert is None) != (args.client_key is None):
        ap.error("--client-cert and --client-key go together")
    if args.job is None and (args.namespace or args.context or args.kubeconfig):
        ap.error("-n, --context and --kubeconfig go with --job")
    return args


def read_token(token_file: str | None) -> str | None:
    """The first non-empty line of `token_file`, else $DDILOCO_TOKEN, else None."""
    from ddiloco.wire.auth import parse_tokens

    if token_file:
        try:
            lines = parse_tokens(Path(token_file).read_text())
        except OSError as e:
            raise UsageError(f"cannot read --token-file {token_file}: {e.strerror}") from None
        if not lines:
            raise UsageError(f"--token-file {token_file} holds no token")
        return lines[0]
    return os.environ.get("DDILOCO_TOKEN", "").strip() or None


def tls_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    from ddiloco.wire.tls import client_context

    for flag, path in (("--ca", ca), ("--client-cert", cert), ("--client-key", key)):
        if path is not None and not Path(path).is_file():
            raise UsageError(f"{flag} {path}: no such file")
    try:
        ctx = client_context(ca, cert, key)
    except (ssl.SSLError, ValueError) as e:
        raise UsageError(f"TLS files refused: {one_line(e)}") from None
    # This client speaks HTTP/1.1 (http.client); offered h2 too, the synchronizer picks it by
    # ALPN and answers an HTTP/1.1 request with HTTP/2 frames.
    ctx.set_alpn_protocols(["http/1.1"])
    return ctx


def explain_http(where: str, code: int, body: bytes) -> Exception:
    """A refusal as an error for the user: 401/403/404 are the command's fault (exit 2)."""
    try:
        err = json.loads(body)
        detail = f"{err.get('error', '')}: {err.get('detail', '')}".strip(": ")
    except (ValueError, AttributeError):
        detail = body[:200].decode("utf-8", "replace")
    if code in (401, 403):
        hint = "check the token (--token-file, DDILOCO_TOKEN)"
        return UsageError(f"{where}: HTTP {code} {detail or 'unauthorized'}; {hint}")
    if code == 404:
        return UsageError(f"{where}: HTTP 404: no /v1/status here; is it a ddiloco synchronizer?")
    return RuntimeFailure(f"{where}: HTTP {code} {detail}".rstrip())


def parse_status(raw: bytes, where: str) -> dict[str, Any]:
    """The answer as a dict that validates as a `Status` (UsageError if it is not one)."""
    from pydantic import ValidationError

    from ddiloco.wire.protocol import Status

    try:
        body = json.loads(raw)
        Status.model_validate(body)
    except (ValueError, ValidationError) as e:
        raise UsageError(f"{where}: the answer is not a ddiloco status ({one_line(e)})") from None
    return body  # type: ignore[no-any-return]


class UrlSource:
    """GET {url}/v1/status with the bearer token (HTTP/1.1, which the synchronizer serves
    beside h2c: urllib needs no torch and no curl handle)."""

    def __init__(self, url: str, token: str, context: ssl.SSLContext | None, timeout: float):
        self.url, self.token, self.context, self.timeout = url.rstrip("/"), token, context, timeout

    def fetch(self) -> Snapshot:
        where = self.url
        req = urllib.request.Request(
            self.url + "/v1/status",
            headers={"Authorization": f"Bearer {self.token}", "Accept": "application/json"},
        )
        https = self.url.lower().startswith("https://")
        try:
            with urllib.request.urlopen(
                req, timeout=self.timeout, context=self.context if https else None
            ) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise explain_http(where, e.code, e.read()) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, ssl.SSLCertVerificationError):
                msg = e.reason.verify_message or str(e.reason)
                raise UsageError(f"{where}: certificate not trusted ({msg}); give --ca") from None
            raise RuntimeFailure(f"cannot reach {where}: {one_line_reason(e.reason)}") from None
        except (OSError, ValueError) as e:  # a timeout, a reset, an invalid URL
            raise RuntimeFailure(f"cannot reach {where}: {one_line_reason(e)}") from None
        except http.client.HTTPException as e:  # something that does not speak HTTP/1.1
            raise RuntimeFailure(f"{where} answered something other than HTTP/1.1: "
                                 f"{type(e).__name__}") from None  # fmt: skip
        return Snapshot(parse_status(raw, where), where)


class ShardedSource:
    """Every shard's `UrlSource`, their answers merged into the job's (`merge_statuses`)."""

    def __init__(self, sources: list[UrlSource]) -> None:
        self.sources = sources

    def fetch(self) -> Snapshot:
        from ddiloco.wire.job_status import merge_statuses
        from ddiloco.wire.protocol import Status

        statuses = [Status.model_validate(s.fetch().raw) for s in self.sources]
        job = merge_statuses(statuses)
        where = f"{len(self.sources)} shards ({', '.join(s.url for s in self.sources)})"
        return Snapshot(job.model_dump(mode="json"), where)


def one_line_reason(reason: object) -> str:
    if isinstance(reason, BaseException):
        return one_line(reason)
    return str(reason)


def render(snap: Snapshot, view: Any, *, stale: str = "") -> Any:
    """The view of one snapshot: the synchronizer's status, or the job's CR status."""
    if snap.is_job_status:
        from ddiloco.cli.status_k8s import job_status_view

        return job_status_view(snap.raw, note=snap.note, stale=stale)
    from ddiloco.wire.protocol import Status

    status = Status.model_validate(snap.raw)
    title = f"ddiloco status  {snap.source}  {time.strftime('%H:%M:%S')}"
    if stale:
        title += f"  [{stale}]"
    return view.render(status, title=title, caption=snap.note or None)


def watch(fetch: Callable[[], Snapshot], first: Snapshot, args: argparse.Namespace) -> int:
    """Refresh every --interval until Ctrl-C; a failure after the first answer is shown in the
    title and retried (a synchronizer restarting is normal)."""
    from rich.console import Console
    from rich.live import Live

    from ddiloco.cli.statusview import StatusView
    from ddiloco.wire.protocol import Status

    console = Console()
    view = StatusView()

    def sample() -> Snapshot:
        snap = fetch()
        if not snap.is_job_status:
            view.update(Status.model_validate(snap.raw))
        return snap

    snap = first
    if not snap.is_job_status:
        view.update(Status.model_validate(snap.raw))
    if args.once:
        console.print(render(snap, view))
        return 0
    last_ok = time.monotonic()

    def loop(show: Callable[[Any], None]) -> None:
        nonlocal snap, last_ok
        while True:
            time.sleep(args.interval)
            stale = ""
            try:
                snap, last_ok = sample(), time.monotonic()
            except (UsageError, RuntimeFailure) as e:
                stale = f"{one_line(e)}; last answer {time.monotonic() - last_ok:.0f}s ago"
            show(render(snap, view, stale=stale))

    try:
        if not console.is_terminal:  # piped: one view per refresh, one after the other
            console.print(render(snap, view))
            loop(console.print)
        with Live(render(snap, view), console=console, auto_refresh=False) as live:
            loop(lambda r: live.update(r, refresh=True))
    except KeyboardInterrupt:
        pass
    return 0


def source_for(args: argparse.Namespace) -> Any:
    """Where snapshots come from: the URL, or the job through the Kubernetes API."""
    if args.job is not None:
        from ddiloco.cli.status_k8s import JobSource

        return JobSource(args)
    token = read_token(args.token_file)
    if token is None:
        raise UsageError("no token: give --token-file or set DDILOCO_TOKEN")
    https = "https://" in args.url.lower()  # any shard's
    context = tls_context(args.ca, args.client_cert, args.client_key) if https else None
    urls = [u.strip() for u in args.url.split(",")]
    if len(urls) > 1:
        return ShardedSource([UrlSource(u, token, context, args.timeout) for u in urls])
    return UrlSource(args.url, token, context, args.timeout)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with usage_errors(PROG):  # the inputs and the first answer: a wrong one exits at once
        source = source_for(args)
        first = source.fetch()
    if args.json:
        if first.note:
            sys.stderr.write(f"{PROG}: {first.note}\n")
        sys.stdout.write(json.dumps(first.raw, indent=2, sort_keys=True) + "\n")
        return 0
    return watch(source.fetch, first, args)


if __name__ == "__main__":
    raise SystemExit(main())
