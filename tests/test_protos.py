"""The committed gRPC modules are what `make protos` generates from the .proto file."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "router/api/protos/kvserve.proto"


def test_generated_modules_are_up_to_date(tmp_path):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I.",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            PROTO,
        ],
        cwd=ROOT,
        check=True,
    )
    for name in ("kvserve_pb2.py", "kvserve_pb2_grpc.py"):
        fresh = (tmp_path / "router" / "api" / "protos" / name).read_text()
        committed = (ROOT / "router" / "api" / "protos" / name).read_text()
        assert committed == fresh, f"router/api/protos/{name} is stale: run `make protos`"
