"""`nugget-rag jobs`: list the background ingest jobs (POST /ingest/jobs) recorded in an index's store, or resume one
whose server stopped, in this process."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .opening import open_index
from .options import UserError, add_stores_options, add_text_states_option


def register(commands: argparse._SubParsersAction, model_options: argparse.ArgumentParser) -> None:
    jobs = commands.add_parser("jobs", parents=[model_options], help="list or resume the ingest jobs of servers",
                               description="The background ingest jobs (POST /ingest/jobs) recorded in an index's "
                                           "nugget store: list them, or resume one whose server stopped, in this "
                                           "process (what it had ingested is skipped).")
    jobs.add_argument("action", choices=["list", "resume"])
    jobs.add_argument("id", nargs="?", metavar="ID", help="the job to resume (ingest-...)")
    jobs.add_argument("--index", type=Path, metavar="DIR", help="the index directory of the jobs' server (without "
                      "it: the index published in --store)")
    jobs.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    add_text_states_option(jobs)
    add_stores_options(jobs)
    jobs.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """`jobs list` the ingest jobs recorded in an index's store; `jobs resume ID` runs a job whose server stopped,
    from the documents it had not ingested, in this process (Ctrl-C leaves it to resume again)."""
    from ..integrations.local.files import NUGGETS_DIR
    from ..serving.ingest_jobs import IngestJobError, reported
    from ..serving.job_records import JobRecords
    from ..state.store import NuggetStore

    if (args.action == "resume") != (args.id is not None):
        raise UserError("give `jobs resume ID` (`jobs list` names them), or `jobs list` without an ID")
    if args.index is None and args.store is None:
        raise UserError("jobs needs --index DIR (the index directory of the jobs' server) or --store REDIS_URL (the "
                        "store of a server that serves the index published there)")
    if args.action == "resume":
        try:
            return resume(args)
        except IngestJobError as err:
            raise UserError(str(err)) from None
    if args.index is not None and not args.store and not (args.index / NUGGETS_DIR).is_dir():
        raise UserError(f"no nugget store in {args.index / NUGGETS_DIR}: give the index directory its server used, "
                        "or the --store URL it used")
    store = args.store.open() if args.store else NuggetStore(directory=args.index / NUGGETS_DIR)
    now = time.time()
    for job in JobRecords(store).all():
        job = reported(job, now)
        print(f"{job.id}  {job.status:<11}  {job.done}/{job.documents} documents, {job.added} new chunks  "
              f"(server {job.server or '?'})" + (f"\n    {job.error}" if job.error else ""))
    return 0


def resume(args: argparse.Namespace) -> int:
    """Run the job `args.id` into the index its server ingested into, as that server would, printing progress."""
    from ..serving.ingest_jobs import IngestJobs
    from ..serving.job_records import JobRecords

    index = open_index(args)
    if index.directory is None:  # the index published in --store, as its server ingests into it
        published = index.published()
        jobs = IngestJobs(published.ingest, JobRecords(published.compressor.store), index=published.location)
        where = published.where
    else:  # the directory, updated as the server adds a job's part
        jobs = IngestJobs(lambda documents, stop: index.ingest(documents, stop)[1], JobRecords(index.compressor.store),
                          index=str(index.directory.resolve()))
        where = str(args.index)
    try:
        job = jobs.resume(args.id)
        print(f"resuming ingest job {job.id} into {where}: {job.done} of {job.documents} documents were ingested "
              "before", flush=True)
        done = job.done
        while (job := jobs.get(args.id)).active:
            if job.done != done and not args.quiet:
                print(f"  {job.done} of {job.documents} documents", flush=True)
                done = job.done
            time.sleep(0.2)
    finally:
        jobs.close()  # interrupted (Ctrl-C): recorded so, to resume again
    print(f"ingest job {job.id} {job.status}: {job.done} of {job.documents} documents ingested, {job.added} new "
          f"chunks in all" + (f"; {job.error}" if job.error else ""))
    return 0 if job.status == "done" else 1
