"""The deploy files say only what the code does.

- every ``kdn`` flag used in deploy/compose.yaml, the Helm chart (templates and
  NOTES.txt), the systemd units and deploy/README.md appears in that command's ``--help``
  (the host tier's files are read closer in test_host_tier_deploy.py);
- every YAML file parses (Helm templates after their ``{{ ... }}`` actions are
  stripped, and also as rendered by ``helm template`` when helm is on PATH);
- the Grafana dashboard parses and queries only metric names (and ``by``
  labels) that the edge, the origin and the shared HTTP middleware register.

No server is started; ``kdn <cmd> --help`` runs as a subprocess, all at once.
"""

from __future__ import annotations

import json
import re

import pytest
import yaml  # pyyaml: the dev extra
from deploy_files import (
    CHART,
    COMPOSE,
    DEPLOY,
    HELM,
    check_flags,
    cmds,
    command_of,
    helm_template,
    strip_template,
    templates,
    text_commands,
    yaml_commands,
)

UNITS = {DEPLOY / "systemd" / "kdn-origin.service": ("origin", "serve"),
         DEPLOY / "systemd" / "kdn-edge@.service": ("edge", "serve"),
         DEPLOY / "systemd" / "kdn-host.service": ("host", "serve")}
DASHBOARD = DEPLOY / "grafana" / "kdn.json"


# --- flags ----------------------------------------------------------------------------


def test_compose_flags_exist(help_flags):
    found: list = []
    for name, svc in yaml.safe_load(COMPOSE.read_text())["services"].items():
        yaml_commands({"command": svc.get("command") or []}, f"compose.yaml:{name}", found)
    assert sorted(c for _, c, _ in found) == [("edge", "serve")] * 4 + [("origin", "serve")]
    check_flags(found, help_flags)
    # trust: records signed at the origin and checked at every edge; the edge token kept to named hosts
    for where, cmd, flags in found:
        want = {"--signing-key"} if cmd == ("origin", "serve") else {"--trusted-keys", "--token-hosts"}
        assert want <= {f.split("=")[0] for f in flags}, f"{where} lacks {want}"
    # every node reaches etcd as the user etcd-init.sh creates, its password from a secret
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        if "--registry" in " ".join(svc.get("command") or []):
            reg = next(a for a in svc["command"] if a.startswith("--registry="))
            assert reg == "--registry=etcd://kdn@etcd:2379/kdn/?password_file=/run/secrets/kdn_etcd_password", name
            assert "kdn_etcd_password" in svc["secrets"], name
            assert svc["depends_on"] == {"etcd-init": {"condition": "service_completed_successfully"}}, name
    assert services["etcd-init"]["entrypoint"][-1] == "/etc/kdn/etcd-init.sh"
    assert (DEPLOY / "etcd-init.sh").exists()


def test_helm_template_flags_exist(help_flags):
    found: list = []
    for p in templates():
        yaml_commands(list(yaml.safe_load_all(strip_template(p.read_text()))), f"templates/{p.name}", found)
    found += text_commands((CHART / "templates" / "NOTES.txt").read_text(), "templates/NOTES.txt")
    assert {("origin", "serve"), ("edge", "serve"), ("host", "serve")} <= cmds(found)
    check_flags(found, help_flags)


def test_systemd_flags_exist(help_flags):
    for unit, cmd in UNITS.items():
        text = unit.read_text()
        found = text_commands(text, unit.name)
        assert cmd in cmds(found), f"{unit.name} does not run kdn {' '.join(cmd)}"
        check_flags(found, help_flags)
        section = re.search(r"^\[Service\]$(.*?)(?=^\[|\Z)", text, re.M | re.S).group(1)
        for key in ("User=", "EnvironmentFile=", "Restart=on-failure", "ProtectSystem=strict", "ReadWritePaths=",
                    "LimitNOFILE="):
            assert re.search(rf"^{re.escape(key)}", section, re.M), f"{unit.name}: [Service] lacks {key}"


def test_deploy_readme_flags_exist(help_flags):
    found = text_commands((DEPLOY / "README.md").read_text(), "deploy/README.md")
    assert {("origin", "serve"), ("edge", "serve"), ("publish",)} <= cmds(found)
    check_flags(found, help_flags)


# --- YAML parses ----------------------------------------------------------------------


def test_the_s3_compose_override_points_the_origin_at_its_seaweedfs(help_flags):
    """deploy/compose.s3.yaml: the origin's store in the SeaweedFS it adds, keys from a secret, telemetry off."""
    over = yaml.safe_load((DEPLOY / "compose.s3.yaml").read_text())
    found: list = []
    yaml_commands({"command": over["services"]["origin"]["command"]}, "compose.s3.yaml:origin", found)
    assert [c for _, c, _ in found] == [("origin", "serve")]
    check_flags(found, help_flags)
    cmd = over["services"]["origin"]["command"]
    store = next(a for a in cmd if a.startswith("--store="))
    from kdn.origin.s3store import parse_s3_url

    loc = parse_s3_url(store.split("=", 1)[1])
    weed = over["services"]["seaweedfs"]
    assert loc.endpoint == f"http://seaweedfs:{next(a for a in weed['command'] if a.startswith('-s3.port=')).split('=')[1]}"
    assert "-master.telemetry=false" in weed["command"]
    assert "--store-credentials=/run/secrets/kdn_s3_credentials" in cmd
    assert "kdn_s3_credentials" in over["services"]["origin"]["secrets"] and "kdn_s3_config" in weed["secrets"]
    base = yaml.safe_load(COMPOSE.read_text())["services"]["origin"]
    # the override replaces the origin's command whole: every other flag of the base one is kept
    assert [a for a in cmd if not a.startswith("--store")] == [a for a in base["command"] if not a.startswith("--store")]
    assert set(base["secrets"]) <= set(over["services"]["origin"]["secrets"])


@pytest.mark.parametrize("rel", [
    "compose.yaml",
    "compose.s3.yaml",
    "compose.host.yaml",
    "prometheus/prometheus.yml",
    "grafana/provisioning/datasources/prometheus.yaml",
    "grafana/provisioning/dashboards/kdn.yaml",
    "helm/kdn/Chart.yaml",
    "helm/kdn/values.yaml",
])
def test_yaml_parses(rel):
    doc = yaml.safe_load((DEPLOY / rel).read_text())
    assert isinstance(doc, dict) and doc


def test_helm_templates_parse_when_stripped():
    kinds = set()
    for p in templates():
        for doc in yaml.safe_load_all(strip_template(p.read_text())):
            if doc is not None:
                assert {"apiVersion", "kind", "metadata"} <= set(doc), f"{p.name}: {doc!r:.200}"
                kinds.add(doc["kind"])
    assert {"Deployment", "StatefulSet", "DaemonSet", "Service", "ServiceMonitor", "NetworkPolicy"} <= kinds


def test_values_budgets_give_requests():
    """The edge memory request is the budget plus overhead: the numbers it is made of are there, as ints."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    edge = values["edge"]
    for key in ("memBudgetMiB", "memOverheadMiB", "memLimitHeadroomMiB", "diskBudgetGiB", "diskHeadroomGiB"):
        assert isinstance(edge[key], int) and edge[key] >= 0, key
    assert values["regions"] and all("name" in r for r in values["regions"])
    edge_tpl = (CHART / "templates" / "edge.yaml").read_text()
    assert "add (int $e.memBudgetMiB) (int $e.memOverheadMiB)" in edge_tpl


@pytest.mark.skipif(HELM is None, reason="helm is not installed: the stripped templates are checked instead")
@pytest.mark.parametrize("sets", [
    [],
    ["etcd.deploy=false", "etcd.endpoint=etcd://etcd.infra:2379/kdn/", "serviceMonitor.enabled=true",
     "inference.podLabels.app=vllm", "edge.diskBudgetGiB=0"],
    ["etcd.deploy=false", "etcd.endpoint=etcd.infra:2379/kdn/", "etcd.client.tls=true", "etcd.client.ca=true",
     "etcd.client.cert=true", "etcd.client.user=kdn", "etcd.client.secret=etcd-client", "auth.signingKeyKey="],
])
def test_helm_renders(sets, help_flags):
    docs = helm_template(sets)
    found: list = []
    yaml_commands(docs, "rendered", found)
    assert {("origin", "serve"), ("edge", "serve")} <= cmds(found)
    check_flags(found, help_flags)
    for d in docs:
        if d["kind"] == "StatefulSet" and d["metadata"]["name"].startswith("t-kdn-edge-"):
            c = d["spec"]["template"]["spec"]["containers"][0]
            assert c["livenessProbe"]["httpGet"]["path"] == c["readinessProbe"]["httpGet"]["path"] == "/healthz"
            budget = int(re.search(r"--mem-budget=(\d+)MiB", " ".join(c["args"])).group(1))
            assert int(c["resources"]["requests"]["memory"].removesuffix("Mi")) > budget
            assert "--token-hosts=**.default.svc.cluster.local" in c["args"]
        if d["kind"] in ("StatefulSet", "Deployment") and "etcd.client.user=kdn" in sets:
            c = d["spec"]["template"]["spec"]["containers"][0]
            if c["name"] != "etcd":
                want = ("--registry=etcds://kdn@etcd.infra:2379/kdn/?ca=/etc/kdn/etcd/ca.crt&cert=/etc/kdn/etcd/tls.crt"
                        "&key=/etc/kdn/etcd/tls.key&password_file=/etc/kdn/etcd/password")
                assert want in c["args"] and {"name": "etcd-client", "mountPath": "/etc/kdn/etcd",
                                              "readOnly": True} in c["volumeMounts"]


# --- Grafana ----------------------------------------------------------------------------


SCRAPE_LABELS = {"instance", "job", "region", "role"}  # added by prometheus.yml / the ServiceMonitor


@pytest.fixture(scope="module")
def exposed() -> dict[str, set[str]]:
    """Every series name the services can expose -> its label names (``le`` for histogram buckets)."""
    from prometheus_client import CollectorRegistry

    from kdn import service
    from kdn.edge.metrics import EdgeMetrics
    from kdn.origin.app import _metrics

    reg = CollectorRegistry()
    EdgeMetrics(reg, lambda: None)
    _metrics(reg)
    service.metrics_middleware_factory(reg, "x")
    labels = {}
    for collector in list(reg._collector_to_names):  # noqa: SLF001 - label names are not public API
        labels.update({n: set(getattr(collector, "_labelnames", ())) for n in reg._collector_to_names[collector]})
    names: dict[str, set[str]] = {}
    for family in reg.collect():
        base = labels.get(family.name, labels.get(family.name + "_total", set()))
        if family.type == "counter":
            names[family.name + "_total"] = base
        elif family.type == "histogram":
            names[family.name + "_bucket"] = base | {"le"}
            names[family.name + "_sum"] = names[family.name + "_count"] = base
        else:
            names[family.name] = base
    assert "kdn_edge_hits_total" in names and "kdn_http_request_seconds_bucket" in names
    return names


def _exprs(dash: dict) -> list[str]:
    out = []

    def walk(panels):
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []) if t.get("expr"))
            walk(p.get("panels", []))

    walk(dash["panels"])
    for v in dash.get("templating", {}).get("list", []):
        q = v.get("query")
        out.append(q.get("query", "") if isinstance(q, dict) else q or "")
    return out


def test_dashboard_metrics_exist(exposed):
    dash = json.loads(DASHBOARD.read_text())
    exprs = _exprs(dash)
    assert len(exprs) >= 20
    used = set()
    bad = []
    for e in exprs:
        metrics = set(re.findall(r"\bkdn_[a-z0-9_]+", e))
        used |= metrics
        bad += [f"{m} in {e}" for m in metrics if m not in exposed]
        allowed = set().union(*(exposed.get(m, set()) for m in metrics)) | SCRAPE_LABELS
        for group in re.findall(r"\bby\s*\(([^)]*)\)", e):
            bad += [f"label {lb!r} in {e}" for lb in (x.strip() for x in group.split(",")) if lb and lb not in allowed]
    assert not bad, "dashboard queries name series or labels nothing registers:\n  " + "\n  ".join(bad)
    # the list: each family is on the dashboard
    for m in ("kdn_edge_hits_total", "kdn_edge_misses_total", "kdn_edge_bytes_served_total", "kdn_edge_fill_seconds_bucket",
              "kdn_edge_evictions_total", "kdn_edge_prefetch_used_total", "kdn_edge_prefetch_wasted_total",
              "kdn_edge_ring_members", "kdn_edge_digest_failures_total", "kdn_edge_fills_in_flight",
              "kdn_edge_tier_bytes", "kdn_edge_tier_budget_bytes", "kdn_origin_chunks_computed_total",
              "kdn_origin_chunks_reused_total", "kdn_http_requests_total", "kdn_http_request_seconds_bucket"):
        assert m in used, f"dashboard lacks {m}"


def test_prometheus_scrapes_every_node():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    for name, svc in services.items():
        hit = command_of(svc.get("command") or [])
        if hit is not None:
            port = next(w.split("=", 1)[1] for w in hit[1] if w.startswith("--port="))
            assert f"{name}:{port}" in targets, f"prometheus.yml does not scrape {name}"
    region_of = {t: sc.get("labels", {}).get("region") for job in cfg["scrape_configs"] for sc in job["static_configs"]
                 for t in sc["targets"]}
    for name, svc in services.items():
        hit = command_of(svc.get("command") or [])
        if hit is not None and hit[0] == ("edge", "serve"):
            region = next(w.split("=", 1)[1] for w in hit[1] if w.startswith("--region="))
            assert region_of[f"{name}:8100"] == region, f"{name}: scrape label region disagrees with --region"
