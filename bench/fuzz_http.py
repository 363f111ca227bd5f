"""Fuzz every HTTP operation of a live origin and edge with schemathesis, against docs/openapi.yaml.

    python -P bench/fuzz_http.py [--examples 300] [--seed 1] [--registry etcd|file]

Starts a real origin (tiny-llama) and one edge on 127.0.0.1 (``bench/lib/edge_helpers.py``
``cluster``), publishes a public and a tenant document so that real addresses, manifests and
jobs exist, then for each service runs every operation its tag in the spec names, in
schemathesis's positive and negative generation modes, ``--examples`` cases each (positive
cases also draw the real addresses, manifests and job). Each case goes out with one of a
set of credentials (none, the publisher's, an edge's, a tenant's, an unknown token, a Basic
header, bytes that are not UTF-8) and its response must pass:

- ``not_a_server_error``: no 5xx, ever;
- the schema: documented status code, content type, headers and body schema;
- ``negative_data_rejection``: input the spec forbids is refused with a 4xx;
- positive data is accepted (2xx/3xx/401/403/404), or refused with one of the 400s the spec
  says depend on the origin's model (vocabulary, context, chat template);
- every error is ``application/json`` ``{"error", "detail"}`` with a one-line detail (the operator
  console's pages, ``/console``, are HTML: their errors are pages without a traceback);
- an answer within 10 s (a hang is a failure).

Then every method a path does not document must get a JSON 405 with ``Allow``; every
accepted publish job must end (``done``, or ``failed`` with a KDN error, not an internal
one); and the servers must have logged no error or traceback. Prints a markdown table per
service and operation; exits 1 on any failure. ``tests/e2e/test_openapi.py`` runs the same
with a few examples per operation.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import re
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "docs" / "openapi.yaml"
for _p in (ROOT / "bench" / "lib",):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from edge_helpers import EDGE_TOKEN, PUBLISH, TENANT_A, cluster, publish  # noqa: E402

SERVICES = ("origin", "edge")
REQUEST_TIMEOUT = 10.0  # seconds: a case without an answer by then is a hang

# Credentials a case is sent with (drawn per case). "generated" keeps what schemathesis made
# for the operation's security scheme (a random bearer token, or none).
AUTHS: dict[str, str | None] = {  # hypothesis starts from the first: the tokens that get past auth
    "publisher": f"Bearer {PUBLISH}",
    "edge": f"Bearer {EDGE_TOKEN}",
    "tenant": f"Bearer {TENANT_A}",
    "anonymous": None,
    "generated": None,
    "unknown": "Bearer " + "z" * 32,
    "basic": "Basic a2RuOmtkbg==",
    "not-utf8": "Bearer \xff\xfe-not-utf8",  # sent as latin-1 bytes: not UTF-8
}

# 400s the spec says depend on the origin's model (POST /v1/publish): valid by the schema, refused.
MODEL_DEPENDENT_400 = re.compile(
    r"'tokens' must be integers in \[0, \d+\)|document is \d+ tokens; this model's context is \d+"
    r"|this model's tokenizer has no chat template|standalone chunks are computed by an origin with --engine hf")
# The body of PUT /v1/objects/{address} (the origin's ingest) is a KDN object, opaque bytes to the schema: valid by
# the schema, refused for what the bytes are (not an object, not the key's address) or a 409 (stored already).
CONTENT_DEPENDENT_400 = re.compile(r"not an object this origin takes|is not the [a-z-]+ address of this key"
                                   r"|the object's header names")
POSITIVE_OK = {401, 403, 404}
ALL_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@dataclass
class OpResult:
    cases: dict[str, int] = field(default_factory=lambda: {"positive": 0, "negative": 0})
    statuses: Counter = field(default_factory=Counter)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (kind, one example of it)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(self.cases.values())


@dataclass
class Known:
    """What the seeding publish made: positive cases draw these too, so hits are exercised."""

    addresses: list[str]  # public chain, then the tenant's
    chains: list[list[str]]
    manifests: list[tuple[str, str]]
    jobs: list[str]


@dataclass
class Report:
    results: dict[str, dict[str, OpResult]]
    log_errors: list[str]
    jobs: Counter
    seconds: float

    @property
    def failures(self) -> list[str]:
        """One line per kind of failure (service, operation, credential, check), with a count and an example."""
        kinds: dict[str, list] = {}
        for svc, ops in self.results.items():
            for label, r in ops.items():
                for kind, example in r.failures:
                    kinds.setdefault(f"{svc} {label}: {kind}", [0, example])[0] += 1
        for e in self.log_errors:
            kinds.setdefault(f"server log: {e.split(':')[0]}", [0, e])[0] += 1
        return [f"{k} (x{n}), e.g. {ex}" for k, (n, ex) in kinds.items()]


class LogWatch(logging.Handler):
    """Server log records at ERROR or above, or with a traceback: each is a failure."""

    def __init__(self) -> None:
        super().__init__(level=logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR or record.exc_info:
            first = record.getMessage().splitlines()[0][:200] if record.getMessage() else ""
            exc = f" ({record.exc_info[0].__name__}: {str(record.exc_info[1])[:200]})" if record.exc_info else ""
            self.records.append(f"{record.name} {record.levelname}: {first}{exc}")


# --- checks --------------------------------------------------------------------------------


def _media_type(response) -> str:
    values = response.headers.get("content-type") or [""]
    return values[0].split(";")[0].strip().lower()


def error_body_is_one_line_json(ctx, response, case):
    """Every 4xx/5xx is ``application/json`` ``{"error": code, "detail": one line}``."""
    if response.status_code < 400:
        return None
    if case.path.startswith("/console") and _media_type(response) == "text/html":
        # The operator console's pages are for a browser: its 401 is the sign-in form, a refusal a page.
        assert b"Traceback" not in (response.content or b""), f"console page {response.status_code} holds a traceback"
        return None
    assert _media_type(response) == "application/json", (
        f"error {response.status_code} has Content-Type {_media_type(response)!r}, not application/json")
    if case.method.upper() == "HEAD":
        return None  # the headers of the GET, no body
    try:
        body = json.loads(response.content)
    except ValueError:
        raise AssertionError(f"error {response.status_code} body is not JSON: {response.content[:120]!r}") from None
    assert isinstance(body, dict) and set(body) == {"error", "detail"}, f"error body is not {{error, detail}}: {body!r:.200}"
    assert isinstance(body["error"], str) and isinstance(body["detail"], str), f"error fields not strings: {body!r:.200}"
    assert "\n" not in body["detail"] and "\r" not in body["detail"], f"detail is not one line: {body['detail']!r:.200}"
    assert "Traceback" not in body["detail"], f"detail holds a traceback: {body['detail']!r:.200}"
    return None


def positive_data_is_accepted(ctx, response, case):
    """Valid data gets 2xx/3xx, a 401/403/404 (credentials, absent things), or a model-dependent 400."""
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive:
        return None
    code = response.status_code
    if code < 400 or code in POSITIVE_OK:
        return None
    if code == 400 and case.method.upper() == "POST" and case.path == "/v1/publish":
        try:
            detail = str(json.loads(response.content).get("detail", ""))
        except (ValueError, AttributeError):
            detail = ""  # not the error shape: error_body_is_one_line_json says so
        if MODEL_DEPENDENT_400.search(detail):
            return None
    if code in (400, 409) and case.method.upper() == "PUT" and case.path == "/v1/objects/{address}":
        try:
            detail = str(json.loads(response.content).get("detail", ""))
        except (ValueError, AttributeError):
            detail = ""
        if code == 409 or CONTENT_DEPENDENT_400.search(detail):
            return None
    detail = response.content[:200].decode("utf-8", "replace") if case.method.upper() != "HEAD" else ""
    raise AssertionError(f"valid data refused with {code}: {detail}")


def _checks():
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi import checks as oa

    return [not_a_server_error, oa.status_code_conformance, oa.content_type_conformance,
            oa.response_headers_conformance, oa.response_schema_conformance, oa.negative_data_rejection,
            positive_data_is_accepted, error_body_is_one_line_json]


# --- the fuzzing (blocking: run it in a thread while the servers' loop serves) ---------------


def _strategy(op, mode, known: Known):
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    base = op.as_strategy(generation_mode=mode)
    if mode is not GenerationMode.POSITIVE:
        return base
    extra = []
    if "{address}" in op.path:
        extra.append(st.sampled_from(known.addresses).flatmap(
            lambda a: op.as_strategy(path_parameters={"address": a})))
    if "{job_id}" in op.path:
        extra.append(st.sampled_from(known.jobs).flatmap(lambda j: op.as_strategy(path_parameters={"job_id": j})))
    if "{namespace}" in op.path:
        extra.append(st.sampled_from(known.manifests).flatmap(
            lambda m: op.as_strategy(path_parameters={"namespace": m[0], "name": m[1]})))
    if op.path in ("/v1/lookup", "/v1/prefetch"):
        extra.append(st.sampled_from(known.chains).flatmap(lambda c: op.as_strategy(body={"addresses": c})))
    if op.path == "/v1/publish":  # plain small documents, which the model takes whatever it is
        doc = st.fixed_dictionaries({"name": st.from_regex(r"[A-Za-z0-9]{1,24}", fullmatch=True),
                                     "text": st.text(st.characters(codec="ascii", min_codepoint=32), min_size=1,
                                                     max_size=300).filter(str.strip)})
        extra.append(doc.flatmap(lambda body: op.as_strategy(body=body)))
    return st.one_of(base, *extra) if extra else base


def _apply_auth(case, auth: str) -> None:
    if auth == "generated" or case.operation.schema.is_security_param_negated(case):
        return  # keep what schemathesis generated (a negated credential stays negated)
    if case.headers is None:
        case.headers = {}
    case.headers.pop("Authorization", None)
    if AUTHS[auth] is not None:
        case.headers["Authorization"] = AUTHS[auth]


def _describe(case, response=None) -> str:
    where = f"{case.method.upper()} {case.formatted_path}"
    if case.query:
        where += f" query={dict(case.query)!r:.120}"
    if response is not None:
        where += f" -> {response.status_code}"
    return where


def fuzz_service(service: str, base_url: str, known: Known, *, examples: int, seed: int,
                 job_ids: set[str]) -> dict[str, OpResult]:
    """Every operation tagged ``service``, positive then negative, ``examples`` cases each."""
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.core.failures import FailureGroup

    schema = schemathesis.openapi.from_path(SPEC).include(tag=service)
    checks = _checks()
    session = requests.Session()
    results: dict[str, OpResult] = {}

    def cases_of(op, mode, res: OpResult):
        @hseed(seed)
        @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck), verbosity=Verbosity.quiet)
        @given(case=_strategy(op, mode, known), auth=st.sampled_from(list(AUTHS)))
        def one(case, auth):
            _apply_auth(case, auth)
            res.cases[mode.value] += 1
            try:
                response = case.call(base_url=base_url, session=session, timeout=REQUEST_TIMEOUT)
            except requests.RequestException as e:
                res.failures.append((f"{auth}: no answer ({type(e).__name__})",
                                     f"{mode.value}: {_describe(case)}: {str(e)[:160]}"))
                return
            res.statuses[response.status_code] += 1
            if op.label == "POST /v1/publish" and response.status_code == 202:
                job_ids.add(json.loads(response.content)["job"])
            try:
                case.validate_response(response, checks=checks)
            except FailureGroup as group:
                for f in group.exceptions:
                    title = getattr(f, "title", type(f).__name__)
                    msg = " ".join(str(getattr(f, "message", "") or f).split())[:300]
                    res.failures.append((f"{auth}: {title}", f"{mode.value}: {_describe(case, response)}: {msg}"
                                                             f" | {case.as_curl_command()[:400]}"))

        return one

    for op_result in schema.get_all_operations():
        op = op_result.ok()
        res = results.setdefault(op.label, OpResult())
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                cases_of(op, mode, res)()
            except Unsatisfiable:
                res.notes.append(f"{mode.value}: nothing to negate")
    results["undocumented methods"] = _undocumented_methods(schema, base_url, known, session)
    return results


def _undocumented_methods(schema, base_url: str, known: Known, session) -> OpResult:
    """Each method a path does not document: a JSON 405 that names the allowed ones."""
    import requests

    res = OpResult()
    documented: dict[str, set[str]] = {}
    for r in schema.get_all_operations():
        op = r.ok()
        documented.setdefault(op.path, set()).add(op.method.upper())
    ns, name = known.manifests[0]
    fill = {"address": known.addresses[0], "job_id": known.jobs[0], "namespace": ns, "name": name}
    for path, methods in documented.items():
        url = base_url + re.sub(r"\{(\w+)\}", lambda m: fill[m.group(1)], path)
        for method in ALL_METHODS:
            if method in methods:
                continue
            res.cases["negative"] += 1
            try:
                r = session.request(method, url, timeout=REQUEST_TIMEOUT, data=b"{}")
            except requests.RequestException as e:
                res.failures.append((f"{method}: no answer", f"{path}: {type(e).__name__}"))
                continue
            res.statuses[r.status_code] += 1
            allow = {m.strip() for m in r.headers.get("Allow", "").split(",") if m.strip()}
            try:
                code = r.json().get("error") if method != "HEAD" else "method_not_allowed"  # HEAD: no body
            except ValueError:
                code = None
            ok = (r.status_code == 405 and r.headers.get("Content-Type", "").startswith("application/json")
                  and code == "method_not_allowed" and allow == methods)
            if not ok:
                res.failures.append((f"{method}: not a JSON 405 with Allow", f"{path} -> {r.status_code} "
                                     f"Allow={sorted(allow)} (documented {sorted(methods)}): {r.text[:120]!r}"))
    return res


# --- a cluster to fuzz --------------------------------------------------------------------------


async def _seed(c) -> Known:
    text = ("Tide tables for the north harbor, kept by the pier master every morning. " * 8)[:500]
    public = await publish(c, text, name="doc")
    tenant = await publish(c, text, name="t", namespace="acme", token=TENANT_A)
    import aiohttp

    # One job id to look up (a republish is idempotent: the same addresses, nothing recomputed).
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
        async with s.post(f"{c.origin_url()}/v1/publish", json={"name": "doc", "text": text}) as r:
            job = (await r.json())["job"]
    return Known(addresses=public["addresses"] + tenant["addresses"],
                 chains=[public["addresses"], tenant["addresses"], public["addresses"][:1]],
                 manifests=[("public", "doc"), ("acme", "t")], jobs=[job])


async def _jobs_outcome(origin_url: str, job_ids: set[str], timeout: float) -> tuple[Counter, list]:
    """Wait for every accepted publish job to end; internal errors (and jobs still pending) are failures."""
    import aiohttp

    outcome: Counter = Counter()
    failures: list[tuple[str, str]] = []
    pending = set(job_ids)
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {PUBLISH}"}) as s:
        while pending and time.monotonic() < deadline:
            for jid in list(pending):
                async with s.get(f"{origin_url}/v1/jobs/{jid}") as r:
                    job = await r.json()
                if job["state"] in ("done", "failed"):
                    pending.discard(jid)
                    outcome[job["state"]] += 1
                    if job["state"] == "failed" and (job["error"] or "").startswith("internal error"):
                        failures.append(("job failed with an internal error",
                                         f"{jid} ({job['namespace']}/{job['name']}): {job['error']}"))
            if pending:
                await asyncio.sleep(0.2)
    outcome["unfinished"] = len(pending)
    if pending:
        failures.append(("job still pending", f"{len(pending)} job(s) after {timeout:g} s"))
    return outcome, failures


async def run(tmp: Path, registry_url: str, *, examples: int, seed: int, services=SERVICES,
              jobs_timeout: float = 120.0) -> Report:
    """Start an origin and one edge, seed them, fuzz each service (in a thread), and collect it all."""
    t0 = time.perf_counter()
    watch = LogWatch()
    root = logging.getLogger()
    root.addHandler(watch)
    try:
        # The publish queue is sized so that fuzzing never fills it (a full queue is a documented 503,
        # and this run asserts that no 5xx is ever answered).
        async with cluster(tmp, registry_url, edges=("e1",), origin_kw={"max_pending_jobs": 1 << 20}) as c:
            known = await _seed(c)
            urls = {"origin": c.origin_url(), "edge": c.edge_url("e1")}
            results: dict[str, dict[str, OpResult]] = {}
            job_ids: set[str] = set()
            for svc in services:
                results[svc] = await asyncio.to_thread(fuzz_service, svc, urls[svc], known, examples=examples,
                                                       seed=seed, job_ids=job_ids)
            jobs, job_failures = await _jobs_outcome(urls["origin"], job_ids, jobs_timeout)
            if job_failures:
                results.setdefault("origin", {}).setdefault("POST /v1/publish", OpResult()).failures.extend(job_failures)
    finally:
        root.removeHandler(watch)
    return Report(results, watch.records, jobs, time.perf_counter() - t0)


def table(report: Report) -> str:
    out = []
    for svc, ops in report.results.items():
        out += [f"### {svc}", "", "| operation | cases (positive + negative) | status codes seen | failures |",
                "| --- | --- | --- | --- |"]
        for label, r in ops.items():
            codes = ", ".join(f"{code} x{n}" for code, n in sorted(r.statuses.items()))
            cases = f"{r.total} ({r.cases['positive']} + {r.cases['negative']})"
            note = f" ({'; '.join(r.notes)})" if r.notes else ""
            out.append(f"| `{label}` | {cases}{note} | {codes} | {len(r.failures)} |")
        total = sum(r.total for r in ops.values())
        out += [f"| **all** | {total} | | {sum(len(r.failures) for r in ops.values())} |", ""]
    jobs = ", ".join(f"{k} {v}" for k, v in sorted(report.jobs.items()))
    out.append(f"Publish jobs accepted during the run: {jobs or 'none'}. Server log errors/tracebacks: "
               f"{len(report.log_errors)}. Wall time: {report.seconds:.0f} s.")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=300, help="cases per operation and generation mode")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--registry", choices=("etcd", "file"), default="etcd",
                    help="a throwaway etcd (needs /usr/bin/etcd), or the embedded SQLite registry")
    ap.add_argument("--service", choices=SERVICES, action="append", help="only this service (repeatable)")
    args = ap.parse_args()
    logging.getLogger().setLevel(logging.WARNING)  # no console handler: the run's LogWatch collects what matters
    with tempfile.TemporaryDirectory(prefix="kdn-fuzz-") as tmp:
        etcd = None
        if args.registry == "etcd":
            from etcd_proc import EtcdProcess

            etcd = EtcdProcess()
            etcd.start()
            registry_url = etcd.url.replace("http://", "etcd://") + "/fuzz/"
        else:
            registry_url = f"file:{tmp}/registry.sqlite3"
        try:
            report = asyncio.run(run(Path(tmp), registry_url, examples=args.examples, seed=args.seed,
                                     services=tuple(args.service or SERVICES)))
        finally:
            if etcd is not None:
                etcd.stop()
    print(f"python -P bench/fuzz_http.py --examples {args.examples} --seed {args.seed} --registry {args.registry}"
          f" (schemathesis {__import__('schemathesis').__version__}, spec {SPEC.relative_to(ROOT)})\n")
    print(table(report))
    failures = report.failures
    if failures:
        print(f"\n{len(failures)} kind(s) of failure:")
        for f in failures:
            print(" -", f[:1500])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
