"""Java services run straight from Maven jars: one classpath per service, resolved once.

No tarball and no Docker: ``mvn dependency:build-classpath`` on a generated POM resolves
the service's artifacts with their dependencies into ``~/.m2`` (network only the first
time), and the classpath is kept in a cache folder of the stack's home. Kafka and s3proxy
both start through here.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from loraplane.infra.processes import StackError
from loraplane.kernel.atomic_file import write_atomic

__all__ = ["Artifact", "classpath", "jars"]

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>loraplane</groupId><artifactId>{artifact_id}</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
{dependencies}
  </dependencies>
</project>
"""
_DEPENDENCY = (
    "    <dependency><groupId>{group}</groupId><artifactId>{artifact}</artifactId>"
    "<version>{version}</version></dependency>"
)


@dataclass(frozen=True)
class Artifact:
    group: str
    artifact: str
    version: str


def classpath(cache: Path, name: str, artifacts: list[Artifact]) -> Path:
    """The file listing the jars of ``artifacts`` and their dependencies (``jars``),
    resolved into ``cache`` once; StackError (with mvn's output) when they cannot be
    fetched."""
    file = cache / "classpath.txt"
    if file.is_file() and (found := jars(file)) and all(Path(j).is_file() for j in found):
        return file
    if shutil.which("mvn") is None or shutil.which("java") is None:
        raise StackError(
            f"{name} needs `java` (17+) and `mvn` on PATH to fetch its jars; "
            "on Debian: apt-get install -y openjdk-17-jre-headless maven"
        )
    cache.mkdir(parents=True, exist_ok=True)
    dependencies = "\n".join(
        _DEPENDENCY.format(group=a.group, artifact=a.artifact, version=a.version) for a in artifacts
    )
    write_atomic(
        cache / "pom.xml",
        _POM.format(artifact_id=f"{cache.name}-runtime", dependencies=dependencies),
    )
    done = subprocess.run(
        ["mvn", "-q", "-B", "dependency:build-classpath", f"-Dmdep.outputFile={file}"],
        cwd=cache,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0 or not file.is_file():
        raise StackError(
            f"could not fetch the {name} jars with mvn (in {cache}):\n"
            f"{done.stdout[-2000:]}{done.stderr[-2000:]}"
        )
    return file


def jars(file: Path) -> list[str]:
    """The jars a classpath file names."""
    return [j for j in file.read_text().strip().split(":") if j]
