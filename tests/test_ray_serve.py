"""`nugget-rag serve --ray`: the server as 2 Ray Serve replicas (a local Ray of 2 CPUs, the tiny model, a Redis
store): the single-process server's answers, an ingest through one replica seen by the other, a killed replica that
loses no other request, scaling from 1 to 2 replicas under a stream of questions that loses none, and bad input
refused before any replica starts."""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'nugget-rag[ray]')")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'ray[serve]')")
pytest.importorskip("fastapi", reason="the server needs the [serve] extra")

from fastapi.testclient import TestClient  # noqa: E402
from langchain_core.documents import Document  # noqa: E402
from pydantic import BaseModel  # noqa: E402
from redis_server import free_port  # noqa: E402
from test_integrations import HashEmbeddings  # noqa: E402
from tiny import tiny_base  # noqa: E402

from nugget_rag import NuggetCompressor, NuggetConfig, NuggetModel, NuggetStore, cli  # noqa: E402
from nugget_rag.generation import batching  # noqa: E402
from nugget_rag.integrations.ingest.ray import ModelMismatchError, connect  # noqa: E402
from nugget_rag.integrations.published.index import PublishedIndex  # noqa: E402
from nugget_rag.serving import create_app  # noqa: E402
from nugget_rag.serving.ray_serve import (  # noqa: E402
    APP_NAME,
    REPLICA_HEADER,
    REPLICA_NICENESS,
    RayServeOptions,
    serve_index,
)

TESTS = Path(__file__).parent
TEXTS = ["The falcon hunts over the river valley and dives at great speed.",
         "Sourdough bread needs flour, water, salt and a starter culture."]
QUESTION = {"question": "What does the falcon do?", "k": 1, "max_new_tokens": 6}


class TinyLoader(BaseModel):
    """The tiny model, as a replica loads it; `step_s`: decoding sleeps this long a step there (answers last)."""

    seed: int = 0
    step_s: float = 0.0

    def __call__(self) -> NuggetModel:
        if self.step_s:
            steps, pause = batching.generation_steps, self.step_s

            def slow(*args, **kwargs):
                for step in steps(*args, **kwargs):
                    time.sleep(pause)
                    yield step

            batching.generation_steps = slow
        return NuggetModel(tiny_base(self.seed), NuggetConfig(ratio=4, scorer_layer=2, lora={"rank": 4}))


def tiny_compressor(store: NuggetStore, seed: int = 0) -> NuggetCompressor:
    return NuggetCompressor(model=TinyLoader(seed=seed)(), store=store)




@pytest.fixture(scope="module")
def served(redis_url, tmp_path_factory):
    """2 replicas (half a CPU each: the other CPU runs the ingest's Ray Data worker) over the index published in the
    Redis store, empty at first."""
    path = os.pathsep.join([str(TESTS.parent), str(TESTS)])  # the replicas import this checkout, tiny, HashEmbeddings
    patch = pytest.MonkeyPatch()  # Serve's limits on a proxy's start (5 s, 10 s, 60 s) are too short on a busy CPU
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        patch.setenv(name, "300")  # read by Serve's controller, a process this local Ray starts
    patch.setattr("ray.serve._private.api.HTTP_PROXY_TIMEOUT", 600, raising=False)
    connect(None, worker_niceness=REPLICA_NICENESS, num_cpus=2, include_dashboard=False,
            logging_level=logging.ERROR, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": path}})
    port = free_port()
    options = RayServeOptions(min_replicas=2, cpus_per_replica=0.5, port=port)
    try:
        serve_index(None, tiny_compressor(NuggetStore.from_redis(redis_url)), HashEmbeddings(), options,
                    model=TinyLoader(step_s=0.05), max_batch=4)
        yield {"port": port, "index_dir": None}  # None: the index published in the store, no shared directory
    finally:
        patch.undo()
        serve.shutdown()
        ray.shutdown()


def request(port: int, method: str, path: str, body: dict | None = None) -> tuple[int, str, dict | list]:
    """One request: its status, the replica that answered, and its JSON (a list of lines for NDJSON)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)  # wide: Ray starts slowly on a busy CPU
    try:
        connection.request(method, path, json.dumps(body) if body is not None else None,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        text = response.read().decode()
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        return response.status, response.getheader(REPLICA_HEADER), lines if len(lines) > 1 else lines[0]
    finally:
        connection.close()


def replicas_seen(port: int, tries: int = 40) -> dict[str, dict]:
    """Each replica's /health, by name (asked until both answered)."""
    seen: dict[str, dict] = {}
    for _ in range(tries):
        status, name, health = request(port, "GET", "/health")
        assert status == 200
        seen[name] = health
        if len(seen) == 2:
            break
    return seen


@pytest.fixture(scope="module")
def ingested(served):
    """TEXTS ingested through one replica (on Ray Data)."""
    status, name, added = request(served["port"], "POST", "/ingest", {"documents": TEXTS})
    assert status == 200 and added == {"added": 2, "chunks": 2}
    return name


def test_a_second_replica_sees_an_index_ingested_through_the_first(served, ingested):
    seen = replicas_seen(served["port"])
    assert len(seen) == 2 and ingested in seen
    assert [health["chunks"] for health in seen.values()] == [2, 2]


def test_the_replicas_run_at_the_servers_priority(served):
    """A Ray started by the server runs the replicas at niceness 0, not Ray's 15 for workers, so that other busy
    processes on the machine do not starve them."""
    replicas = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if cmdline.read_bytes().startswith(b"ray::ServeReplica:nugget-rag:NuggetReplica"):
                replicas.append(int(cmdline.parent.name))
        except OSError:  # a process that has just ended
            pass
    assert len(replicas) == 2
    assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in replicas] == [REPLICA_NICENESS] * 2 == [0, 0]


def without_cache(answer: dict) -> dict:
    """The answer but its prompt cache's details (a replica's cache may be warm)."""
    return {**answer, "usage": {k: v for k, v in answer["usage"].items() if k != "input_token_details"}}


def test_answers_equal_the_single_process_servers(served, ingested, redis_url):
    index = PublishedIndex(tiny_compressor(NuggetStore.from_redis(redis_url)), HashEmbeddings()).current()
    with TestClient(create_app(index)) as client:
        alone = client.post("/ask", json={**QUESTION, "stream": False}).json()
        chat = {"messages": [{"role": "user", "content": QUESTION["question"]}], "max_tokens": 6, "k": 1}
        alone_chat = client.post("/v1/chat/completions", json=chat).json()
    for _ in range(4):  # both replicas, most likely
        status, _, answer = request(served["port"], "POST", "/ask", {**QUESTION, "stream": False})
        assert status == 200 and without_cache(answer) == without_cache(alone)
    status, _, lines = request(served["port"], "POST", "/ask", QUESTION)  # streamed: the same text
    assert "".join(line.get("text", "") for line in lines) == alone["answer"] and lines[-1]["sources"]
    status, _, completion = request(served["port"], "POST", "/v1/chat/completions", chat)
    assert completion["choices"] == alone_chat["choices"] and completion["usage"] == alone_chat["usage"]


def test_bad_input_is_refused_before_any_replica_starts(served, ingested, redis_url, tmp_path, capsys, monkeypatch):
    address = f"127.0.0.1:{free_port()}"
    monkeypatch.setattr(cli.loading, "load_embeddings", lambda args: HashEmbeddings())
    monkeypatch.setattr(cli.loading, "ray_model_loader", lambda args: TinyLoader())
    started = []
    monkeypatch.setattr(serve, "run", lambda *args, **kwargs: started.append(args))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    serving = ["serve", "--store", redis_url, "--port", str(free_port())]

    assert cli.main([*serving, f"--ray={address}"]) == 2
    assert f"cannot reach the Ray cluster at {address}" in capsys.readouterr().err
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    assert cli.main([*serving[:1], "--store", unreachable, "--ray"]) == 2
    assert f"cannot reach Redis at {unreachable}" in capsys.readouterr().err
    for replicas in ("0", "3..1", "two"):
        assert cli.main([*serving, "--ray", "--replicas", replicas]) == 2
        assert "--replicas" in capsys.readouterr().err
    assert cli.main([*serving, "--replicas", "2"]) == 2
    assert "add --ray" in capsys.readouterr().err
    monkeypatch.setattr(cli.loading, "load_compressor", lambda args, store_dir=None: tiny_compressor(
        args.store.open(), seed=1))
    assert cli.main([*serving, "--ray", "--replicas", "2"]) == 2
    assert "the index 'default' published in redis://" in capsys.readouterr().err
    with pytest.raises(ModelMismatchError, match="the index published in redis://.* holds nuggets of tiny-llama"):
        serve_index(None, tiny_compressor(NuggetStore.from_redis(redis_url), seed=1), HashEmbeddings(),
                    RayServeOptions(), model=TinyLoader(seed=1))
    assert not started and serve.status().applications[APP_NAME].status == "RUNNING"


def test_replicas_autoscale_between_the_bounds_on_requests_in_flight():
    options = RayServeOptions(min_replicas=1, max_replicas=4, target_ongoing_requests=6).deployment_options(32)
    assert options["autoscaling_config"] == {"min_replicas": 1, "initial_replicas": 1, "max_replicas": 4,
                                             "target_ongoing_requests": 6}
    assert options["max_ongoing_requests"] == 32 and options["graceful_shutdown_timeout_s"] == 600
    assert RayServeOptions(min_replicas=3).deployment_options(8)["num_replicas"] == 3
    with pytest.raises(ValueError, match="max_replicas=1 is below min_replicas=2"):
        RayServeOptions(min_replicas=2, max_replicas=1)


def stream(port: int, started: list) -> dict:
    """A long streamed answer (6 s): the replica that gives it (None: it failed before its response started), and
    whether it ended with its sources."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/ask", json.dumps({**QUESTION, "max_new_tokens": 120}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        name = response.getheader(REPLICA_HEADER)
        if response.status != 200:
            return {"replica": name, "whole": False}
        lines = []
        try:  # a replica killed before this stream's first line cuts it there (its headers were sent)
            lines.append(json.loads(response.readline()))
            started.append(name)
            lines += [json.loads(line) for line in response if line.strip()]
        except (http.client.HTTPException, OSError, ValueError):
            pass
        return {"replica": name, "whole": bool(lines) and "sources" in lines[-1]}
    finally:
        connection.close()


def answered_by_both(port: int, deadline: float) -> set[str]:
    """The replicas that answered a question, asked one after another until both have (warm), or `deadline`."""
    names: set[str] = set()
    while len(names) < 2 and time.monotonic() < deadline:
        status, name, _ = request(port, "POST", "/ask", {**QUESTION, "stream": False})
        if status == 200:
            names.add(name)
    return names


def test_a_replica_killed_mid_stream_loses_no_other_request(served, ingested):
    """Only once both replicas run, have answered, and have each started a stream is one killed: its precondition,
    not the behaviour under test, is said so (a skip) where a busy machine cannot meet it."""
    port, deadline = served["port"], time.monotonic() + 300  # wide: a busy CPU
    while running_replicas() < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    warm = answered_by_both(port, deadline)
    started: list[str] = []
    with ThreadPoolExecutor(8) as pool:
        futures: list = []
        while len(set(started)) < 2 and len(futures) < 8 and time.monotonic() < deadline:
            if len(started) + sum(f.done() for f in futures) >= len(futures):  # each stream sent has started
                futures.append(pool.submit(stream, port, started))
            time.sleep(0.02)
        if len(set(started)) < 2:
            for future in futures:
                future.result()
            pytest.skip(f"precondition not met in 300 s: {running_replicas()} replicas RUNNING, {len(warm)} answered "
                        f"a question, {len(futures)} streams all went to {sorted(set(started))}; a replica is killed "
                        "only while both stream")
        victim = started[-1]  # its answer has just started; the other replica's stream runs or has ended
        actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(victim))
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        results = [future.result() for future in futures]
    assert not all(r["whole"] for r in results if r["replica"] == victim)  # killed mid-stream
    survivor = [r for r in results if r["replica"] not in (victim, None)]
    assert survivor and all(r["whole"] for r in survivor)
    status, name, _ = request(port, "POST", "/ask", {**QUESTION, "stream": False})
    assert status == 200 and name != victim


def running_replicas() -> int:
    deployment = serve.status().applications[APP_NAME].deployments["NuggetReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def ask_until(port: int, stop: threading.Event, answers: list) -> None:
    """Questions one after another until `stop`: each answer's (status, replica, body), or (None, None, the error)
    when it got no response."""
    while not stop.is_set():
        try:
            answers.append(request(port, "POST", "/ask", {**QUESTION, "stream": False}))
        except (OSError, http.client.HTTPException, ValueError) as err:
            answers.append((None, None, repr(err)))


def test_scaling_from_1_to_2_replicas_under_a_stream_of_questions_loses_none(served, ingested, redis_url):
    """Serve redeploys to 2 replicas while 3 clients ask one question after another: the one replica keeps answering
    until the new ones run (a redeploy replaces it too), and every question gets its answer."""
    def deploy(replicas: int) -> None:
        serve_index(served["index_dir"], tiny_compressor(NuggetStore.from_redis(redis_url)), HashEmbeddings(),
                    RayServeOptions(min_replicas=replicas, cpus_per_replica=0.5, port=served["port"]),
                    model=TinyLoader(step_s=0.05), max_batch=4)

    deploy(1)
    assert running_replicas() == 1
    answers: list[tuple] = []
    stop, deadline = threading.Event(), time.monotonic() + 300  # wide: a busy CPU
    with ThreadPoolExecutor(3) as pool:
        askers = [pool.submit(ask_until, served["port"], stop, answers) for _ in range(3)]
        while len(answers) < 3 and time.monotonic() < deadline:  # the stream flows before the scaling
            time.sleep(0.05)
        before = len(answers)
        deploy(2)
        scaled, deadline = len(answers), time.monotonic() + 600  # both new replicas answer: counted from their start
        while len({name for _, name, _ in answers[scaled:]}) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        stop.set()
        for asker in askers:
            asker.result()
    failed = [answer for answer in answers if answer[0] != 200 or not answer[2]["answer"] or not answer[2]["sources"]]
    assert not failed and 3 <= before < scaled, failed[:3]  # answered before and during the redeploy
    assert len({name for _, name, _ in answers[scaled:]}) == 2 and running_replicas() == 2


def test_a_replica_over_a_directory_reads_each_save_and_ingests_under_its_lock(tmp_path, monkeypatch):
    """The directory path without a cluster: the replica's index follows what another process saves, its ingest
    (the pipeline in-process here, in place of Ray Data) is saved for every replica, and a stopped one saves nothing."""
    from nugget_rag.cancellation import RequestCancelled
    from nugget_rag.integrations import NuggetIndex
    from nugget_rag.integrations.ingest.pipeline import ingest
    from nugget_rag.serving import ray_serve
    from nugget_rag.serving.ray_serve import ReplicaIndex, replica_spec

    compressor = tiny_compressor(NuggetStore(directory=tmp_path / "store"))
    directory = tmp_path / "index"
    NuggetIndex(compressor, HashEmbeddings(), chunk_tokens=64, chunk_overlap=8).save(directory)
    spec = replica_spec(directory, compressor, HashEmbeddings(), RayServeOptions(), model=TinyLoader(), app={})
    replica = ReplicaIndex(spec, compressor)
    assert len(replica) == 0 and replica.location == str(directory.resolve())

    with NuggetIndex.updating(directory, compressor, HashEmbeddings()) as other:  # another replica's ingest
        other.ingest([Document(page_content=TEXTS[0])])
    assert len(replica) == 1

    monkeypatch.setattr(ray_serve, "ingest_on_ray", lambda spec, index, documents, stop=None: ingest(index, documents, stop))
    assert replica.ingest([Document(page_content=TEXTS[1])], lambda: False) == 1
    assert len(replica) == 2 and len(NuggetIndex.open(directory, compressor, HashEmbeddings())) == 2
    with pytest.raises(RequestCancelled):
        replica.ingest([Document(page_content="A third text that is never saved.")], lambda: True)
    assert len(NuggetIndex.open(directory, compressor, HashEmbeddings())) == 2
