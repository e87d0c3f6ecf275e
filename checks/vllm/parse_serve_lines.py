"""Each `vllm serve` line (a JSON list of argument lists on stdin) through vLLM 0.33.0's own
parser, as `vllm serve` builds it (entrypoints/cli/serve.py) and validates it."""
import json, sys
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform
vllm.platforms._current_platform = CpuPlatform()  # no GPU here: the parser only needs a device to name defaults
from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.utils.argparse_utils import FlexibleArgumentParser
top = FlexibleArgumentParser(prog="vllm")
subparsers = top.add_subparsers(dest="subparser")
serve = make_arg_parser(subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]"))
failed = 0
lines = json.load(sys.stdin)
for args in lines:
    try:
        parsed = top.parse_args(["serve", *args])
        validate_parsed_serve_args(parsed)
    except SystemExit as exc:
        failed += 1
        print("REFUSED", exc, args)
        continue
    assert parsed.model_tag == args[0]
    assert parsed.override_generation_config == json.loads(args[args.index("--override-generation-config") + 1])
print(f"{len(lines) - failed} of {len(lines)} serve lines parsed by vLLM 0.33.0's parser")
sys.exit(1 if failed else 0)
