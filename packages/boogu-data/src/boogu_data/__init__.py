"""Parquet schemas, the Boogu chat template and dataset converters for Boogu-Image FlowGRPO.

Depends on pyarrow and pillow only (no torch), so data preparation runs anywhere.

* :mod:`boogu_data.template`: upstream's system prompts, the per-encoding selection rule (with its
  deliberate empty-instruction quirk), chat messages and their ChatML text.
* :mod:`boogu_data.schema`: the T2I and edit parquet schemas.
* :mod:`boogu_data.read` / :mod:`boogu_data.write`: validated, streaming `PromptRecord` I/O.
* :mod:`boogu_data.convert`: the OCR and edit-OCR converters behind the ``boogu-data`` CLI.
* :mod:`boogu_data.atomic`: atomic file and folder commits (temporary sibling, fsync, rename) and the
  clean-up of temporaries left by killed processes, shared by every boogu package.
"""

from boogu_data.atomic import (
    AtomicOutputs,
    atomic_file,
    atomic_write_bytes,
    atomic_write_text,
    commit_folder,
    fsync_dir,
    owner_alive,
    recover_folder,
    remove_stale,
    stage_folder,
    temp_path,
)
from boogu_data.convert import ConversionReport, SplitReport, convert_edit_ocr, convert_ocr
from boogu_data.errors import DatasetError, OutputError, ReferenceLayoutWarning
from boogu_data.read import dataset_files, read_records
from boogu_data.record import DatasetKind, PromptRecord
from boogu_data.schema import EDIT_SCHEMA, SCHEMA_VERSION, T2I_SCHEMA, schema_for
from boogu_data.template import (
    IMAGE_PLACEHOLDER,
    SYSTEM_PROMPT_T2I,
    SYSTEM_PROMPT_TI2I,
    build_messages,
    render_text,
    select_system_prompt,
)
from boogu_data.write import write_records

__version__ = "0.1.0"

__all__ = [
    "EDIT_SCHEMA",
    "IMAGE_PLACEHOLDER",
    "SCHEMA_VERSION",
    "SYSTEM_PROMPT_T2I",
    "SYSTEM_PROMPT_TI2I",
    "T2I_SCHEMA",
    "AtomicOutputs",
    "ConversionReport",
    "DatasetError",
    "DatasetKind",
    "OutputError",
    "PromptRecord",
    "ReferenceLayoutWarning",
    "SplitReport",
    "__version__",
    "atomic_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "build_messages",
    "commit_folder",
    "convert_edit_ocr",
    "convert_ocr",
    "dataset_files",
    "fsync_dir",
    "owner_alive",
    "read_records",
    "recover_folder",
    "remove_stale",
    "render_text",
    "schema_for",
    "select_system_prompt",
    "stage_folder",
    "temp_path",
    "write_records",
]
