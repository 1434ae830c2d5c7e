"""The versions a process runs, checked against the ones its application was built with.

On a cluster every node installs kvserve and Ray itself; a node set up at another time
or from another tree may differ. Such a replica refuses to start, with a message that
names the difference, rather than fail later on a pickled config or a proto field."""

from importlib.metadata import version

import ray


def running_versions() -> dict[str, str]:
    return {"kvserve": version("kvserve"), "ray": ray.__version__}


class VersionMismatchError(RuntimeError):
    pass


def check_versions(expected: dict[str, str] | None, role: str) -> None:
    """Raise unless this process runs `expected` (None: nothing to check)."""
    if not expected:
        return
    running = running_versions()
    differences = [
        f"{name} {running.get(name)} here but {want} where the application was built"
        for name, want in sorted(expected.items())
        if running.get(name) != want
    ]
    if differences:
        node = ray.util.get_node_ip_address()
        raise VersionMismatchError(
            f"this {role} on node {node} runs {'; '.join(differences)}. Install the same kvserve "
            "and Ray on every node (cluster.yaml pins them) and deploy again."
        )
