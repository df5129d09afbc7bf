"""`ddiloco operator`: run the DecoupledDiLoCoJob operator (kopf) with a liveness endpoint.

    kubectl apply -f deploy/crds/ -f deploy/rbac/
    ddiloco operator --all-namespaces                 # uses in-cluster config or $KUBECONFIG
    ddiloco operator -n team-a -n team-b --verbose
    curl localhost:8080/healthz                       # kopf's liveness probe

Every other knob is a DDILOCO_OPERATOR_* environment variable (config.py). The equivalent
`kopf run -m ddiloco.operator.handlers` works too; this entry point adds the settings.
"""

from __future__ import annotations

import argparse
import logging
import os

from ddiloco.cli.errors import usage_errors
from ddiloco.operator.config import get_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ddiloco operator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # -- what to watch
    parser.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="namespace to watch (repeatable); default: DDILOCO_OPERATOR_NAMESPACES",
    )
    parser.add_argument(
        "-A",
        "--all-namespaces",
        action="store_true",
        help="watch every namespace (needs the ClusterRole of deploy/rbac/)",
    )
    # -- how to talk
    parser.add_argument(
        "--liveness",
        default=None,
        metavar="URL",
        help="liveness endpoint, e.g. http://0.0.0.0:8080/healthz; '' disables",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    args = parser.parse_args(argv)

    if args.liveness is not None:
        os.environ["DDILOCO_OPERATOR_LIVENESS_ENDPOINT"] = args.liveness
        get_settings.cache_clear()
    with usage_errors("ddiloco operator"):  # a bad DDILOCO_OPERATOR_* value: one line, exit 2
        cfg = get_settings()
    namespaces = args.namespace or ([] if args.all_namespaces else cfg.namespace_list())

    import kopf  # imported late so `ddiloco operator --help` is instant

    from ddiloco.operator import redact

    redact.install()  # before the first log line: no record may carry a credential
    kopf.configure(verbose=args.verbose or cfg.log_level.upper() == "DEBUG")
    logging.getLogger("ddiloco").setLevel("DEBUG" if args.verbose else cfg.log_level.upper())
    # The kubernetes client's loggers ("client", urllib3) stay at WARNING even with --verbose:
    # at DEBUG they describe requests, and some of ours carry Secrets.
    for name in ("client", "urllib3", "kubernetes"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # kopf's liveness endpoint is served by aiohttp, whose access log at INFO is one line per
    # probe (two every 10 s under the chart's probes): it buried what the operator did.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger(__name__).info(
        "Starting the operator: namespaces=%s resync=%ss status_url=%s",
        namespaces or "all",
        cfg.resync_seconds,
        cfg.status_url_template,
    )

    logging.getLogger("kopf.objects").addFilter(_quiet_timer)
    from ddiloco.operator import handlers  # registers the handlers with kopf

    del handlers
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=cfg.standalone,
        liveness_endpoint=cfg.liveness_endpoint or None,
    )
    return 0


def _quiet_timer(record: logging.LogRecord) -> bool:
    """Drop kopf's "Timer 'reconcile_job' succeeded." line: it would repeat every resync for
    every job. Failures, and everything the handlers say themselves, still get through."""
    return not (
        "reconcile_job" in record.getMessage()
        and record.getMessage().endswith(("succeeded.", "is invoked."))
    )
