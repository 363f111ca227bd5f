"""The host tier's deploy files agree with ``kdn host serve`` and with what surrounds it.

- every host command line (the chart's DaemonSet, deploy/compose.host.yaml, deploy/systemd/kdn-host.service) goes
  through ``kdn host serve``'s own parser and builds its ``HostConfig`` (nothing is served);
- the folders its ``--socket`` and ``--segment`` name are the ones shared with the engines (hostPath folders in
  the chart, the volume and the IPC namespace in compose, the RuntimeDirectory and /dev/shm in the unit), and its
  key and token files are on read-only secret mounts;
- socket and segment go to the group the pod, service or unit runs with, and the engines are in it;
- the chart's memory request covers the segment, compose's shm_size holds it;
- the example engine's command parses with its own parser and names the host's socket and real edges;
- what docs/operations.md tells an engine (its pod's mounts, vLLM's ``host``) is what the chart serves.

The chart is read twice: its templates stripped of their actions (always), and rendered by helm (when on PATH).
"""

from __future__ import annotations

import importlib.util
import json
import posixpath
import re
import tomllib
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml
from deploy_files import (
    CHART,
    COMPOSE,
    DEPLOY,
    HELM,
    ROOT,
    command_of,
    compose_at_defaults,
    helm_template,
    options,
    strip_template,
)

from kdn import cli
from kdn.host.config import HostConfig
from kdn.host.server import MAX_PATH
from kdn.units import parse_size

HOST = ("host", "serve")
COMPOSE_HOST = DEPLOY / "compose.host.yaml"
UNIT = DEPLOY / "systemd" / "kdn-host.service"
SECRET_FLAGS = ("trusted-keys", "token-file", "upstream-token-file")


@pytest.fixture
def host_config(monkeypatch):
    """``words`` (what follows ``kdn host serve``) -> the HostConfig that command builds; nothing is served."""
    import kdn.host.tier
    from kdn.registry.signing import Verifier

    built: list[HostConfig] = []

    async def serve(config: HostConfig) -> None:
        built.append(config)

    monkeypatch.setattr(kdn.host.tier, "serve", serve)
    monkeypatch.setattr(Verifier, "from_file", classmethod(lambda cls, path: None))  # (the file is the pod's)

    def build(words: list[str]) -> HostConfig:
        args = cli.build_parser().parse_args([*HOST, *words])
        assert args.func(args) == 0
        config = built.pop()
        assert len(config.socket.encode()) <= MAX_PATH, config.socket
        return config

    return build


def host_flags() -> set[str]:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")  # noqa: SLF001
    serve = next(a for a in sub.choices["host"]._actions if a.dest == "host_command").choices["serve"]  # noqa: SLF001
    return {s for a in serve._actions for s in a.option_strings}  # noqa: SLF001


# --- the chart ----------------------------------------------------------------------------


def daemonsets(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d and d.get("kind") == "DaemonSet"]


def check_pod(spec: dict) -> list[str]:
    """A host pod's mounts against its flags; its ``kdn host serve`` words."""
    (c,) = [c for c in spec["containers"] if command_of(c.get("args", [])) is not None]
    cmd, words = command_of(c["args"])
    assert cmd == HOST
    assert {w.split("=", 1)[0] for w in words if w.startswith("--")} <= host_flags()
    opts = options(words)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def holding(path: str) -> tuple[dict, dict]:
        m = mounts.get(posixpath.dirname(path))
        assert m is not None, f"{path}: nothing is mounted at its folder"
        return m, volumes[m["name"]]

    (init,) = spec["initContainers"]
    sc = spec["securityContext"]
    shared = set()
    for flag in ("socket", "segment"):  # node folders the engine pods mount at the same paths
        m, v = holding(opts[flag])
        assert v["hostPath"]["type"] == "DirectoryOrCreate" and not m.get("readOnly"), flag
        assert {"name": m["name"], "mountPath": m["mountPath"]} in init["volumeMounts"], flag
        assert m["mountPath"] in init["command"][-1], f"the init container leaves {m['mountPath']} root's"
        shared.add(v["name"])
    assert len(shared) == 2 and opts["segment"].startswith("/dev/shm/")
    assert f"chown {sc['runAsUser']}:{sc['fsGroup']} " in init["command"][-1]
    assert "chmod 0750 " in init["command"][-1]
    assert opts["group"] == str(sc["fsGroup"]), "--group is not a group the host is in"
    for flag in SECRET_FLAGS:  # from the Secret, read-only, and only what the host reads
        m, v = holding(opts[flag])
        items = {i["path"] for i in v["secret"]["items"]}
        assert m.get("readOnly") and posixpath.basename(opts[flag]) in items, flag
        assert len(v["secret"]["items"]) == len(SECRET_FLAGS), "the host pod mounts more of the Secret than it reads"
    for name, (path,) in parse_qs(urlsplit(opts.get("registry", "")).query).items():  # etcd's CA, cert, password
        m, v = holding(path)
        assert m.get("readOnly") and "secret" in v, name
    for probe in ("startupProbe", "livenessProbe"):
        assert f"connect('{opts['socket']}')" in c[probe]["exec"]["command"][-1], probe
    return words


def test_the_stripped_daemonset_mounts_what_its_flags_name():
    (ds,) = daemonsets(list(yaml.safe_load_all(strip_template((CHART / "templates" / "host.yaml").read_text()))))
    words = check_pod(ds["spec"]["template"]["spec"])
    assert {"--socket=/run/kdn/host.sock", "--segment=/dev/shm/kdn/host.seg"} <= set(words)
    tpl = (CHART / "templates" / "host.yaml").read_text()
    assert "{{- $memRequest := add (int $h.segmentMiB) (int $h.memOverheadMiB) }}" in tpl
    assert "- --segment-bytes={{ int $h.segmentMiB }}MiB" in tpl


def test_values_hold_the_host_tier_off_by_default():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    h = values["hostTier"]
    assert h["enabled"] is False
    for key in ("segmentMiB", "budgetMiB", "memOverheadMiB", "memLimitHeadroomMiB", "engineGroup"):
        assert isinstance(h[key], int) and h[key] >= 0, key
    assert h["engineGroup"] not in (0, values["podSecurityContext"]["runAsGroup"])
    assert h["socketDir"] != h["segmentDir"]


@pytest.mark.skipif(HELM is None, reason="helm is not installed: the stripped template is checked instead")
@pytest.mark.parametrize("sets", [
    ["hostTier.enabled=true"],
    ["hostTier.enabled=true", "hostTier.segmentMiB=32768", "hostTier.budgetMiB=30000", "hostTier.engineGroup=4242",
     "hostTier.tokensKey=engines.txt", "hostTier.eviction=s3-fifo", "origin.enabled=false",
     "hostTier.socketDir=/run/kdn-b", "hostTier.segmentDir=/dev/shm/kdn-b"],
    ["hostTier.enabled=true", "etcd.deploy=false", "etcd.endpoint=etcd.infra:2379/kdn/", "etcd.client.tls=true",
     "etcd.client.ca=true", "etcd.client.cert=true", "etcd.client.user=kdn", "etcd.client.secret=etcd-client"],
    ["hostTier.enabled=true", "hostTier.followPolicies=false"],
    ["hostTier.enabled=true", "hostTier.extraDomains[0].name=tenant-b", "hostTier.extraDomains[0].engineGroup=10003",
     "hostTier.extraDomains[0].socketDir=/run/kdn-b", "hostTier.extraDomains[0].segmentDir=/dev/shm/kdn-b",
     "hostTier.extraDomains[0].segmentMiB=2048"],
])
def test_the_rendered_daemonsets_serve_their_region(sets, host_config):
    docs = helm_template(sets)
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    edges = {d["metadata"]["labels"]["kdn.dev/region"]: d for d in docs if d["kind"] == "StatefulSet"
             and d["metadata"]["labels"].get("app.kubernetes.io/component") == "edge"}
    sets_ = dict(s.split("=", 1) for s in sets)
    domains = ["default"] + [v for k, v in sets_.items() if re.fullmatch(r"hostTier\.extraDomains\[\d+\]\.name", k)]
    placed = sorted((d["metadata"]["labels"]["kdn.dev/region"], d["metadata"]["labels"]["kdn.dev/host-domain"])
                    for d in daemonsets(docs))
    assert placed == sorted((r, dom) for r in edges for dom in domains)  # one per region and trust domain
    seen: dict[str, list] = {r: [] for r in edges}
    for ds in daemonsets(docs):
        spec = ds["spec"]["template"]["spec"]
        config = host_config(check_pod(spec))
        region = ds["metadata"]["labels"]["kdn.dev/region"]
        domain = ds["metadata"]["labels"]["kdn.dev/host-domain"]
        assert ds["spec"]["selector"]["matchLabels"]["kdn.dev/host-domain"] == domain  # selectors do not overlap
        index = domains.index(domain) - 1

        def want(key: str, default: str) -> str:
            """The value set for this DaemonSet's domain: its own, else hostTier's, else the chart's default."""
            return sets_.get(f"hostTier.extraDomains[{index}].{key}", sets_.get(f"hostTier.{key}", default))
        # placed like the region's edges, filled from the region's edge Service
        assert spec["affinity"]["nodeAffinity"] == edges[region]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
        (edge,) = config.edges
        url = urlsplit(edge)
        name, ns, *_ = url.hostname.split(".")
        svc = services[name]
        assert (ns, url.port) == ("default", svc["spec"]["ports"][0]["port"])
        assert svc["spec"]["selector"]["kdn.dev/region"] == region
        assert svc["spec"]["selector"]["app.kubernetes.io/component"] == "edge"
        assert (config.origin is not None) == (sets_.get("origin.enabled") != "false")
        # the region's policies, from the registry its edges use
        edge_args = options(command_of(edges[region]["spec"]["template"]["spec"]["containers"][0]["args"])[1])
        if sets_.get("hostTier.followPolicies") == "false":
            assert config.region is None and config.registry is None
        else:
            assert (config.region, config.registry) == (region, edge_args["registry"])
        # the segment's pages are the pod's: requested, with room for the process
        c = spec["containers"][0]
        request = int(c["resources"]["requests"]["memory"].removesuffix("Mi")) << 20
        limit = int(c["resources"]["limits"]["memory"].removesuffix("Mi")) << 20
        assert config.segment_bytes == int(want("segmentMiB", "4096")) << 20
        assert config.segment_bytes + (64 << 20) <= request <= limit
        assert config.held_budget <= config.segment_bytes
        assert config.group == want("engineGroup", "10002")
        assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
        folders = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
        assert folders == {want("socketDir", "/run/kdn"), want("segmentDir", "/dev/shm/kdn")}
        seen[region].append((config.group, folders))
    for region, hosts in seen.items():  # trust domains on one node share no group and no folder
        assert len({g for g, _ in hosts}) == len(hosts), region
        assert sum(len(f) for _, f in hosts) == len(set().union(*(f for _, f in hosts))), region


@pytest.mark.skipif(HELM is None, reason="helm is not installed")
def test_the_chart_renders_no_host_tier_unless_enabled():
    assert not daemonsets(helm_template([]))


# --- compose ------------------------------------------------------------------------------


def test_compose_host_and_engine_share_socket_and_shm(host_config):
    base = compose_at_defaults(COMPOSE)
    over = compose_at_defaults(COMPOSE_HOST)
    services = {**base["services"], **over["services"]}
    assert not set(base["services"]) & set(over["services"]), "the override adds services, it changes none"
    host, engine = over["services"]["host"], over["services"]["engine"]
    kdn_image = base["services"]["origin"]["image"]  # the image deploy/Dockerfile builds
    assert host["image"] == engine["image"] == kdn_image
    cmd, words = command_of(host["command"])
    assert cmd == HOST
    config = host_config(words)
    # the socket: a named volume both mount at its folder (the engine read-only)
    folder = posixpath.dirname(config.socket)
    (volume,) = [v.split(":")[0] for v in host["volumes"] if v.split(":")[1:] == [folder]]
    assert volume in over["volumes"] and f"{volume}:{folder}:ro" in engine["volumes"]
    # the segment: in the host's /dev/shm, which the engine shares; room for it there
    assert posixpath.dirname(config.segment) == "/dev/shm"
    assert host["ipc"] == "shareable" and engine["ipc"] == "service:host"
    shm = re.fullmatch(r"(\d+)([kmg])b?", str(host["shm_size"]).lower())
    assert int(shm.group(1)) << {"k": 10, "m": 20, "g": 30}[shm.group(2)] > config.segment_bytes
    # the group: the host is in it, the engine runs in it as another user
    assert config.group in host["group_add"]
    uid, gid = engine["user"].split(":")
    assert gid == config.group and uid != "10001"
    # files from secrets the service is given, fills from real edges of one region (and the origin)
    for path in (config.trusted_keys, config.token_file, config.upstream_token_file):
        assert posixpath.dirname(path) == "/run/secrets" and posixpath.basename(path) in host["secrets"]
    regions = set()
    for url in (*config.edges, config.origin):
        u = urlsplit(url)
        _, served = command_of(services[u.hostname]["command"])
        assert options(served)["port"] == str(u.port), url
        regions.add(options(served).get("region", "origin"))
    assert regions - {"origin"} == {config.region}, "the host fills from edges of another region than it follows"
    edge_registry = options(command_of(services[urlsplit(config.edges[0]).hostname]["command"])[1])["registry"]
    assert config.registry == edge_registry and "kdn_etcd_password" in host["secrets"]
    assert host["depends_on"]["etcd-init"] == {"condition": "service_completed_successfully"}
    assert set(host["depends_on"]) <= set(services) and "host" in engine["depends_on"]
    assert config.socket in host["healthcheck"]["test"][-1]


def test_compose_engine_runs_the_example_with_the_hosts_socket():
    over = compose_at_defaults(COMPOSE_HOST)
    host, engine = over["services"]["host"], over["services"]["engine"]
    assert engine["entrypoint"][0] == "python" and "engine" in engine["profiles"]
    script = engine["entrypoint"][1]
    source = next(v.split(":")[0] for v in engine["volumes"] if v.split(":")[1] == script)
    path = (COMPOSE_HOST.parent / source).resolve()
    spec = importlib.util.spec_from_file_location("engine_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parser().parse_args(engine["command"])
    assert args.socket == options(host["command"])["socket"]
    base = compose_at_defaults(COMPOSE)["services"]
    assert all(command_of(base[urlsplit(u).hostname]["command"])[0] == ("edge", "serve") for u in args.edge)
    assert args.model == options(command_of(base["origin"]["command"])[1])["model"]  # the origin's model
    for path in (args.token_file, args.trusted_keys):
        assert posixpath.basename(path) in engine["secrets"]
    secrets = {**compose_at_defaults(COMPOSE)["secrets"], **over["secrets"]}
    assert set(engine["secrets"]) | set(host["secrets"]) <= set(secrets)
    # what it calls is there (imported, as the engine would)
    import kdn.adapters.hf as hf
    import kdn.client.host

    assert all(hasattr(hf, n) for n in ("agenerate", "load_model", "prompt_tokens"))
    assert hasattr(kdn.client.host, "HostClient")


def test_the_image_holds_every_part_and_the_socket_folder():
    """The Dockerfile copies every folder pyproject.toml makes a part of kdn (kdn.host is host/), and makes
    /run/kdn the image user's, which a named volume mounted there copies."""
    parts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for folder in parts.values():
        assert f"COPY {folder}/ {folder}/\n" in dockerfile, folder
    assert "install -d -o kdn -g kdn -m 0755 /run/kdn" in dockerfile


# --- systemd --------------------------------------------------------------------------------


def test_the_unit_runs_in_the_engines_group_with_its_runtime_directory(host_config):
    text = UNIT.read_text()
    service = dict(re.findall(r"^([A-Za-z]+)=(.*)$", re.search(r"^\[Service\]$(.*?)(?=^\[)", text, re.M | re.S)
                              .group(1), re.M))
    env = dict(re.findall(r"^#   (KDN_[A-Z_]+)=(.*)$", text, re.M))  # the example host.env in the header
    line = re.search(r"^ExecStart=/usr/local/bin/kdn host serve (.*?)$", text.replace("\\\n", " "), re.M).group(1)
    words = re.sub(r"\$\{?(KDN_[A-Z_]+)\}?", lambda m: env[m.group(1)], line).split()
    config = host_config(words)
    assert posixpath.dirname(config.socket) == f"/run/{service['RuntimeDirectory']}"
    assert service["RuntimeDirectoryMode"] == "0750"
    assert config.group == service["Group"] and service["User"] == "kdn"
    assert "kdn" in service["SupplementaryGroups"].split()  # the /etc/kdn files are root:kdn 0640
    assert posixpath.dirname(config.segment) == "/dev/shm" and "/dev/shm" in service["ReadWritePaths"].split()
    assert service["ExecStopPost"] == f"-/bin/rm -f {config.segment}"
    assert config.edges == (env["KDN_EDGE"],) and config.segment_bytes == parse_size(env["KDN_SEGMENT_BYTES"])
    assert (config.region, config.registry) == (env["KDN_REGION"], env["KDN_REGISTRY"])
    header = text.split("[Unit]")[0]  # installs each file the host reads
    for path in (config.trusted_keys, config.token_file, config.upstream_token_file):
        assert re.search(rf"^#   install .* {re.escape(path)}\s", header, re.M), path


# --- what the docs tell an engine -------------------------------------------------------------


def section() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    return text[text.index("\n### Deploy: one per machine, a DaemonSet in the Helm chart\n"):]


def test_the_engine_pod_in_the_docs_mounts_what_the_daemonset_serves():
    text = section()
    pod = yaml.safe_load(re.search(r"```yaml\n(spec:.*?)```", text, re.S).group(1))["spec"]
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    h = values["hostTier"]
    (ds,) = daemonsets(list(yaml.safe_load_all(strip_template((CHART / "templates" / "host.yaml").read_text()))))
    host = ds["spec"]["template"]["spec"]
    host_mounts = {m["name"]: m["mountPath"] for m in host["containers"][0]["volumeMounts"]}
    node_of = {"socket": h["socketDir"], "segment": h["segmentDir"]}
    engine_volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = pod["containers"][0]["volumeMounts"]
    assert len(mounts) == 2
    for m in mounts:
        assert m["readOnly"] is True
        (which,) = [k for k, p in host_mounts.items() if p == m["mountPath"]]
        assert engine_volumes[m["name"]] == node_of[which]
    assert pod["securityContext"]["supplementalGroups"] == [h["engineGroup"]]
    assert pod["securityContext"]["runAsUser"] not in (0, values["podSecurityContext"]["runAsUser"])


def test_the_vllm_setting_in_the_docs_is_a_valid_connector_config_on_the_charts_socket():
    from kdn.adapters.vllm.config import ConnectorConfig

    extra = json.loads(" ".join(re.search(r'`(\{"edges".*?\})`', section(), re.S).group(1).split()))
    cfg = ConnectorConfig.from_extra(extra, consumer=True, producer=False)
    tpl = (CHART / "templates" / "host.yaml").read_text()
    assert f"- --socket={cfg.host}\n" in tpl
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert f'"host": "{cfg.host}"' in notes and f'HostClient("{cfg.host}"' in notes
    assert f'HostClient("{cfg.host}"' in section()
