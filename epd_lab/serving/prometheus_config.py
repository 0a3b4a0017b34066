"""A Prometheus scrape config for a launched topology: one job per role, each process's ``host:port`` a target.

    epd-lab launch --encoders 1 --prefills 1 --decodes 1 --proxy --prometheus-config prometheus.yml
    prometheus --config.file=prometheus.yml

The file is JSON, which YAML (Prometheus's config language) reads as it is. With the deployment's shared secret
in a file (``EPD_SECRET_FILE``), each job sends it as its bearer token from that file (``credentials_file``): the
secret itself is never written. docs/metrics.md lists what each role exports.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.parse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from epd_lab import security

__all__ = ["FLAG", "SCRAPE_INTERVAL_S", "launch_targets", "pop_flag", "scrape_config", "write_launch_config",
           "write_scrape_config"]

FLAG = "--prometheus-config"
FLAG_HELP = ("write a Prometheus scrape config for the launched topology to FILE (one job per role, each "
             "process's host:port a target; docs/metrics.md)")
SCRAPE_INTERVAL_S = 5.0  # Prometheus's own default is 60 s: too coarse for a benchmark run of a minute


def scrape_config(targets: Mapping[str, Sequence[str]], interval_s: float = SCRAPE_INTERVAL_S,
                  credentials_file: str | None = None) -> dict[str, Any]:
    """The config (as a dict) scraping `targets` (role → base URLs) every `interval_s`: job ``epd-lab-<role>``,
    its targets the URLs' ``host:port``; `credentials_file`: a file holding the bearer token every job sends."""
    if not interval_s > 0:
        raise ValueError(f"the scrape interval must be positive, got {interval_s}")
    interval = f"{round(interval_s * 1000)}ms"
    jobs = []
    for role, urls in targets.items():
        if not urls:
            continue
        parsed = [urllib.parse.urlsplit(url) for url in urls]
        job: dict[str, Any] = {"job_name": f"epd-lab-{role}", "metrics_path": "/metrics",
                               "scheme": parsed[0].scheme or "http",
                               "static_configs": [{"targets": [p.netloc for p in parsed], "labels": {"role": role}}]}
        if credentials_file is not None:
            job["authorization"] = {"type": "Bearer", "credentials_file": credentials_file}
        jobs.append(job)
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


def write_scrape_config(path: str | os.PathLike, targets: Mapping[str, Sequence[str]],
                        interval_s: float = SCRAPE_INTERVAL_S, credentials_file: str | None = None) -> Path:
    """`scrape_config` written to `path` (its folder made if missing); the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(scrape_config(targets, interval_s, credentials_file), indent=2) + "\n")
    return out


def launch_targets(cluster: Any) -> dict[str, list[str]]:
    """A running `epd_lab.launch.Cluster`'s servers by role: encoders, prefills, decodes, monolithic servers, and
    its entry point (the proxy; the front, before monolithic replicas)."""
    targets = {"encoder": list(cluster.encoder_urls), "prefill": list(cluster.prefill_urls),
               "decode": list(cluster.decode_urls), "monolithic": list(cluster.monolithic_urls)}
    entry = cluster.proxy_url
    if entry and entry not in cluster.monolithic_urls:
        targets["front" if cluster.monolithic_urls else "proxy"] = [entry]
    return targets


def write_launch_config(path: str | os.PathLike, cluster: Any, secret: bytes | None) -> Path:
    """The scrape config of `cluster` (`launch_targets`) written to `path`. With a `secret`, the jobs read it from
    ``EPD_SECRET_FILE``; a secret given otherwise is not written out, and stderr says that the scrapes will be
    refused (401) until it is in a file."""
    credentials = (os.environ.get(security.ENV_SECRET_FILE) or None) if secret is not None else None
    if secret is not None and credentials is None:
        print(f"{FLAG}: the shared secret is not in a file ({security.ENV_SECRET_FILE}): Prometheus's scrapes will "
              f"be refused (401) until its config names one as credentials_file", file=sys.stderr)
    return write_scrape_config(path, launch_targets(cluster), credentials_file=credentials)


def pop_flag(argv: Sequence[str] | None) -> tuple[Path | None, list[str]]:
    """`FLAG`'s file, and `argv` (None: the process's) without it; launch's other options are its topology's."""
    ap = argparse.ArgumentParser(prog="epd-lab launch", add_help=False, allow_abbrev=False)
    ap.add_argument(FLAG, type=Path, metavar="FILE", default=None)
    known, rest = ap.parse_known_args(sys.argv[1:] if argv is None else list(argv))
    return known.prometheus_config, rest
