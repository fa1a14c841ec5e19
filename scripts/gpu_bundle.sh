# Sourced by the GPU scripts before gpu_python.sh: unpacks what a machine without a package index was handed.
# Needs `log`. Environment:
#   PARTS   a folder of scripts/offline_bundle.py parts (PARTS/1, PARTS/2, ...): joined into /tmp/bundle, every file's
#           SHA-256 checked (a missing or damaged part stops the call here, exit 3); sets WHEELS and DATA
#   CORPUS  a folder of scripts/build_corpus.py files (plain or .xz), put where the stages read it (../corpus)
#   READY   ready sets (`nugget-rag train --config X --write-ready DIR`: DIR itself, or one .tar.xz of it), put at
#           /tmp/ready; sets ready_flags (--ready-dir) for the trainer, which then loads them instead of tokenising
if [ -n "${PARTS:-}" ]; then
  if ! python3 scripts/offline_bundle.py --join "$PARTS"/* --into /tmp/bundle >>"$LOG_FILE" 2>&1; then
    log "the bundle in $PARTS does not join: $(tail -1 "$LOG_FILE"); nothing trained"
    exit 3
  fi
  export WHEELS=/tmp/bundle/wheels DATA=/tmp/bundle/data
fi
if [ -n "${CORPUS:-}" ]; then
  mkdir -p ../corpus
  for file in "$CORPUS"/*; do
    case "$file" in
      *.xz) python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' \
              "$file" "../corpus/$(basename "${file%.xz}")" ;;
      *) cp "$file" ../corpus/ ;;
    esac
  done
  log "corpus: $(ls ../corpus | tr '\n' ' ')"
fi
ready_flags=()
if [ -n "${READY:-}" ]; then
  if ! ready_dir=$(python3 - "$READY" 2>>"$LOG_FILE" <<'PY'
import pathlib, shutil, sys, tarfile
source, target = pathlib.Path(sys.argv[1]), pathlib.Path("/tmp/ready")
shutil.rmtree(target, ignore_errors=True)
if source.is_dir():
    shutil.copytree(source, target)
else:
    with tarfile.open(source, "r:xz") as archive:
        archive.extractall(target, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
folders = {p.parent.parent for p in target.rglob("ready.json")}
if len(folders) != 1:
    sys.exit(f"READY={source} holds no folder of ready sets (each a folder with ready.json)")
print(folders.pop())
PY
  ); then
    log "READY=$READY does not unpack: $(tail -1 "$LOG_FILE"); nothing trained"
    exit 3
  fi
  ready_flags=(--ready-dir "$ready_dir")
  log "ready sets: $(ls "$ready_dir" | tr '\n' ' ')"
fi
