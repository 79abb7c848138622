"""The packages depend one way (DESIGN.md): training -> modeling_fwp -> fwp_kernels, model_cards beside training.

modeling_fwp holds model code only: none of its modules may import the publishing package (model_cards) or the
scripts (training); fwp_kernels knows nothing of models or transformers. Checked in fresh interpreters, where
``sys.modules`` shows everything an import pulled in.
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest

import modeling_fwp
from modeling_fwp import pretrained

from conftest import tiny_model

ROOT = Path(__file__).resolve().parents[1]

# For each "package:forbidden,names" argument in turn: imports the package and every module under it, then records
# which forbidden top-level names are in sys.modules by then.
IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
report = []
for step in sys.argv[1:]:
    package, forbidden = step.split(":")
    root = importlib.import_module(package)
    names = [package] + [info.name for info in pkgutil.walk_packages(root.__path__, package + ".")]
    for name in names:
        importlib.import_module(name)
    loaded = sorted({key.split(".")[0] for key in sys.modules} & set(forbidden.split(",")))
    report.append({"package": package, "file": root.__file__, "modules": names, "loaded": loaded})
print(json.dumps(report))
"""


@pytest.mark.parametrize(
    "steps",
    [
        # model_cards after modeling_fwp in one interpreter: model_cards may import modeling_fwp, never training
        [("modeling_fwp", ["model_cards", "training", "fwp_training"]), ("model_cards", ["training", "fwp_training"])],
        [("fwp_kernels", ["modeling_fwp", "transformers", "model_cards", "training", "fwp_training"])],
    ],
    ids=["modeling_fwp-then-model_cards", "fwp_kernels"],
)
def test_packages_import_one_way(steps):
    arguments = [f"{package}:{','.join(forbidden)}" for package, forbidden in steps]
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_ALL, *arguments], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for report in json.loads(proc.stdout.strip().splitlines()[-1]):
        # this checkout, not an installed copy
        assert Path(report["file"]).resolve().is_relative_to(ROOT), report["file"]
        assert len(report["modules"]) > 1  # the walk found the package's modules
        assert report["loaded"] == [], f"importing {report['package']} imported {report['loaded']}"


def test_without_a_publisher_models_save_without_a_card(tmp_path, monkeypatch):
    """modeling_fwp writes cards only through the publisher model_cards registers; without one, save_pretrained
    writes the checkpoint and its code, no card, and push_to_hub is transformers' own."""
    import model_cards

    assert pretrained.registered_publisher() is model_cards.hub
    model = tiny_model(modeling_fwp.DeltaNetConfig)
    model.save_pretrained(tmp_path / "with")
    monkeypatch.setattr(pretrained, "_PUBLISHER", None)
    model.save_pretrained(tmp_path / "without")
    assert (tmp_path / "with" / "README.md").is_file() and not (tmp_path / "without" / "README.md").exists()
    with_files = {p.name for p in (tmp_path / "with").iterdir()} - {"README.md"}
    assert with_files == {p.name for p in (tmp_path / "without").iterdir()}
    with pytest.raises(ImportError, match="import model_cards"):
        model.save_pretrained(tmp_path / "push", push_to_hub=True, repo_id="me/x")


# The scripts' package under its installed name: setup.cfg maps `fwp_training` to training/ (package_dir), done here by
# hand so that the test needs no installation. Every module is imported under that name, then every console script.
IMPORT_INSTALLED = r"""
import configparser, importlib, importlib.util, json, pkgutil, sys
from pathlib import Path
cfg = configparser.ConfigParser()
cfg.read("setup.cfg")
folders = dict(line.split(" = ") for line in cfg["options"]["package_dir"].strip().splitlines())
folder = Path(folders["fwp_training"]).resolve()
spec = importlib.util.spec_from_file_location("fwp_training", folder / "__init__.py",
                                              submodule_search_locations=[str(folder)])
package = importlib.util.module_from_spec(spec)
sys.modules["fwp_training"] = package
spec.loader.exec_module(package)
names = [info.name for info in pkgutil.walk_packages(package.__path__, "fwp_training.")]
for name in names:
    importlib.import_module(name)
scripts = {}
for line in cfg["options.entry_points"]["console_scripts"].strip().splitlines():
    command, target = (part.strip() for part in line.split("="))
    module, function = target.split(":")
    scripts[command] = callable(getattr(importlib.import_module(module), function))
loaded = sorted(key for key in sys.modules if key == "training" or key.startswith("training."))
print(json.dumps({"modules": names, "scripts": scripts, "loaded": loaded, "packages": cfg["options"]["packages"]}))
"""


def test_training_installs_as_fwp_training_with_console_scripts():
    """Under its installed name the scripts' package never loads a top-level `training` (its modules import each
    other relatively), and every console script of setup.cfg names a function of it."""
    proc = subprocess.run([sys.executable, "-c", IMPORT_INSTALLED], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "fwp_training" in report["packages"] and "fwp_training.train_lm" in report["modules"]
    assert report["loaded"] == [], f"fwp_training imported {report['loaded']}"
    assert ({"fwp-train-lm", "fwp-finetune-fwl", "fwp-eval-lm", "fwp-demo", "fwp-train-transfo-xl"}
            <= set(report["scripts"]))
    assert all(report["scripts"].values()), report["scripts"]


# From the repository's root, where this folder is also a top-level ``kernels``: transformers' probe for the Hub's
# ``kernels`` library imports it (before fwp_kernels and modeling_fwp are imported, or after), and transformers >= 5.25
# requires that library and imports it at start-up.
PROBE_KERNELS = r"""
import json, sys
from pathlib import Path
from transformers.utils.import_utils import is_kernels_available
probe_first = sys.argv[1] == "probe_first"
if probe_first:
    available = is_kernels_available()
import fwp_kernels, modeling_fwp
from transformers import AutoConfig
if not probe_first:
    available = is_kernels_available()
kernels = sys.modules.get("kernels")
folder = Path(fwp_kernels.__file__).resolve().parent
files = {name: getattr(module, "__file__", None) for name, module in sys.modules.items()
         if name == "kernels" or name.startswith("kernels.")}
print(json.dumps({"available": available, "is_fwp_kernels": kernels is fwp_kernels,
                  "from_this_folder": sorted(name for name, file in files.items()
                                             if file and folder in Path(file).resolve().parents),
                  "submodules": sorted(name for name in files if name != "kernels")}))
"""


def _hub_kernels_init():
    """The Hub's ``kernels/__init__.py`` where that distribution is installed, else None."""
    import importlib.metadata
    try:
        init = Path(importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return init if init.is_file() else None


@pytest.mark.parametrize("order", ["probe_first", "probe_after"])
def test_kernels_folder_probed_by_transformers_is_the_installed_package(order):
    proc = subprocess.run([sys.executable, "-c", PROBE_KERNELS, order], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if _hub_kernels_init() is None:
        # one module object under both names: no second copy of the kernels' modules, C++ builds and torch ops; and
        # transformers does not take this folder for the Hub's library
        assert out == {"available": False, "is_fwp_kernels": True, "from_this_folder": ["kernels"], "submodules": []}
    else:
        # the Hub's library is installed: `kernels` is that library, loaded from where it is installed, and nothing
        # of this folder is loaded under the name `kernels`
        assert out["is_fwp_kernels"] is False and out["from_this_folder"] == [], out


def test_folder_imported_as_kernels_is_the_hubs_library_where_installed():
    """Imported by the name ``kernels`` from the repository's root, this folder stands for the Hub's library where
    that is installed (transformers >= 5.25 imports it at start-up), else for fwp_kernels."""
    probe = ("import sys, kernels, fwp_kernels; from pathlib import Path; "
             "print(Path(kernels.__file__).resolve(), Path(fwp_kernels.__file__).resolve(), kernels is fwp_kernels)")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    file, installed, same = proc.stdout.split()
    hub = _hub_kernels_init()
    if hub is None:
        assert (file, same) == (installed, "True")
    else:
        assert (file, same) == (str(hub.resolve()), "False") and file != installed
