"""The flguard command: help lists the commands, version works, errors are clear."""

from typer.testing import CliRunner

from flguard.cli import app
from flguard.config import ConfigError, StrictModel


def test_help_lists_commands_and_version_runs():
    runner = CliRunner()
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("version", "audit", "attack"):
        assert command in result.output
    version = runner.invoke(app, ["version"])
    assert version.exit_code == 0 and version.output.startswith("flguard 0.1.0")


def test_audit_writes_per_sample_and_per_class_tables(tmp_path):
    result = CliRunner().invoke(app, ["audit", "--model", "linear", "--dataset", "digits", "--samples", "4",
                                      "--batch-size", "4", "--init", "uniform,kaiming", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    rows = (tmp_path / "audit.csv").read_text().splitlines()
    assert len(rows) == 1 + 8 and rows[0].startswith("init,index,label,grad_norm,lambda_max")
    assert "Per initialisation" in result.output


def test_strict_model_errors_name_field_value_and_rule():
    class Example(StrictModel):
        rounds: int = 1

    try:
        Example(rounds="many")
    except ConfigError as error:
        assert "Example.rounds: value='many' is not allowed" in str(error)
    else:
        raise AssertionError("no error")
