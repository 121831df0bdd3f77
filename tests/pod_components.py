"""Two components for the pod stand-in's own tests (tests/test_pod_runs.py): one writes a folder, the
other reads it back and reports what of this machine it can see. No postponed annotations here: KFP
reads the annotations at run time, as in components/."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Output


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def write_folder(out: Output[Artifact]):
    import os

    os.makedirs(os.path.join(out.path, "sub"))
    with open(os.path.join(out.path, "a.txt"), "w") as f:
        f.write("a")
    with open(os.path.join(out.path, "sub", "b.txt"), "w") as f:
        f.write("b")


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def read_folder(folder: Input[Artifact], host_paths: list[str], hog_mib: int, cache_mib: int) -> str:
    import json
    import os
    import time

    with open(os.path.join(folder.path, "sub", "b.txt")) as f:
        b = f.read()
    hog = bytearray(hog_mib << 20)  # zero pages: touch them so they count
    for i in range(0, len(hog), 4096):
        hog[i] = 1
    cache = os.environ["DYNRUBRIC_CACHE"]
    os.makedirs(cache, exist_ok=True)
    for i in range(cache_mib):  # as a model download fills the cache: a MiB at a time
        with open(os.path.join(cache, f"part-{i}"), "wb") as f:
            f.write(os.urandom(1 << 20))
    if cache_mib:
        time.sleep(2)  # long enough for the volume's check to look
    seen = [p for p in host_paths if os.path.exists(p)]
    return json.dumps({"uri": folder.uri, "path": folder.path, "b": b, "seen": seen})


@dsl.pipeline(name="pod-stand-in")
def folder_pipeline(host_paths: list[str], hog_mib: int, cache_mib: int) -> str:
    written = write_folder()
    read = read_folder(
        folder=written.outputs["out"], host_paths=host_paths, hog_mib=hog_mib, cache_mib=cache_mib
    )
    return read.output
