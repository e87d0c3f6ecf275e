"""The image role's state on the host."""
from serving.host_programs import ProgramResultError
from roles.image.role import ARCH_NAMES, INSPECT, INSPECT_PROGRAM


def test_image_matches_arch_cuda_and_recorded_digest(host, expected, fix):
    rt, ref = expected["runtime"], expected["image"]
    out = host.run(INSPECT_PROGRAM.script({"RUNTIME": rt, "REF": ref}))
    try:
        found = INSPECT.result_of(out.stdout)
    except ProgramResultError:
        found = None
    assert out.rc == 0 and found, f"{ref} is not present; {fix}"
    arch, digest = found["arch"], found["digest"]
    assert arch == ARCH_NAMES[expected["arch"]], \
        f"{ref} is built for {arch} but the host is {expected['arch']}: remove it ({rt} rmi {ref}) and {fix}"
    record = host.file(expected["image_record"])
    assert record.exists, f"no digest recorded at deploy ({expected['image_record']}); {fix}"
    recorded = record.content_string.split("\n")
    assert recorded[:2] == [ref, digest], \
        f"{ref} has digest {digest}, deploy recorded {recorded[1] if len(recorded) > 1 else '-'}; {fix}"
