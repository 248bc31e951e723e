"""The handlers of `moe-pipeline`'s commands, which flows/cli.py declares: each takes the
parsed arguments and returns the exit code."""

EXIT_CONFIG = 2  # bad configuration or input: nothing was run or written


# Help texts read from the families registry (it imports torch): flows/cli.py calls them only
# for the command line being parsed.
def _families(dense: bool) -> str:
    from moe.hf.families.registry import FAMILIES

    return ", ".join(t for t, f in FAMILIES.items() if f.upcycled == dense)


def _architectures() -> str:
    from moe.hf.families.registry import exporters

    return ", ".join(f.model_type for f in exporters())


def import_help() -> str:
    return (
        f"a local Hugging Face folder ({_families(False)}; {_families(True)} upcycled to "
        "moe.num_experts) as a model folder model.init takes"
    )


def arch_help() -> str:
    return (
        f"prefer this architecture ({_architectures()}) when it represents the model exactly "
        "(default: the one it was imported from, else the first that does)"
    )
