"""Summary values for TensorBoard's plugins, built from the ``tensorboard`` package's protos only.

- HParams: the hparams plugin's ``session_start_info`` / ``session_end_info`` (what
  ``hparams.hp.hparams()`` writes in Keras/PyTorch), so the HPARAMS tab lists the run with its
  hyperparameters, its final status and the last value of each scalar.
- Images: a PNG as an image summary (IMAGES tab).
- Text: a string tensor for the text plugin (TEXT tab), which renders Markdown, tables included.
"""

from __future__ import annotations

import math
import re
import struct
import time
from collections.abc import Mapping, Sequence
from typing import Any

HPARAMS_START_TAG = "_hparams_/session_start_info"
HPARAMS_END_TAG = "_hparams_/session_end_info"
_HPARAMS_PLUGIN = "hparams"
_HPARAMS_DATA_VERSION = 0

_SURROGATES = re.compile("[\ud800-\udfff]")


def hparams_start_value(params: Mapping[str, Any], start_time: float) -> Any:
    """The ``session_start_info`` summary value holding ``params``.

    Numbers and bools keep their type (the HPARAMS tab filters and sorts them as such);
    anything else is shown as its string.
    """
    from tensorboard.plugins.hparams import plugin_data_pb2

    info = plugin_data_pb2.SessionStartInfo(group_name="", start_time_secs=start_time)
    for key, value in params.items():
        slot = info.hparams[utf8(str(key)).decode()]
        if isinstance(value, bool):
            slot.bool_value = value
        elif isinstance(value, (int, float)) and math.isfinite(float(value)):
            slot.number_value = float(value)
        else:
            slot.string_value = utf8(value if isinstance(value, str) else repr(value)).decode()
    return _hparams_value(HPARAMS_START_TAG, plugin_data_pb2.HParamsPluginData(
        version=_HPARAMS_DATA_VERSION, session_start_info=info
    ))


def hparams_end_value(exit_code: int) -> Any:
    """The ``session_end_info`` summary value: success for exit code 0, failure otherwise."""
    from tensorboard.plugins.hparams import api_pb2, plugin_data_pb2

    status = api_pb2.STATUS_SUCCESS if exit_code == 0 else api_pb2.STATUS_FAILURE
    info = plugin_data_pb2.SessionEndInfo(status=status, end_time_secs=time.time())
    return _hparams_value(HPARAMS_END_TAG, plugin_data_pb2.HParamsPluginData(
        version=_HPARAMS_DATA_VERSION, session_end_info=info
    ))


def _hparams_value(tag: str, data: Any) -> Any:
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2

    metadata = summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(
            plugin_name=_HPARAMS_PLUGIN, content=data.SerializeToString()
        )
    )
    # The plugin reads only the metadata; the tensor is an empty float vector, as TF writes it.
    empty = tensor_pb2.TensorProto(
        dtype=types_pb2.DT_FLOAT,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=0)]
        ),
    )
    return summary_pb2.Summary.Value(tag=tag, metadata=metadata, tensor=empty)


def image_value(tag: str, png: bytes) -> Any:
    """An image summary of PNG bytes (size and channels read from the PNG header)."""
    from tensorboard.compat.proto import summary_pb2

    width, height, channels = png_size(png)
    image = summary_pb2.Summary.Image(
        height=height, width=width, colorspace=channels, encoded_image_string=png
    )
    return summary_pb2.Summary.Value(tag=tag, image=image)


def png_size(png: bytes) -> tuple[int, int, int]:
    """``(width, height, channels)`` from a PNG's IHDR chunk."""
    if len(png) < 26 or png[:8] != b"\x89PNG\r\n\x1a\n" or png[12:16] != b"IHDR":
        raise ValueError("not a PNG image")
    width, height = struct.unpack(">II", png[16:24])
    channels = {0: 1, 2: 3, 3: 3, 4: 2, 6: 4}.get(png[25], 3)  # by PNG colour type
    return width, height, channels


def text_value(tag: str, text: str) -> Any:
    """A text-plugin summary value (a scalar string tensor; the plugin renders Markdown)."""
    from tensorboard.compat.proto import summary_pb2, tensor_pb2, types_pb2

    return summary_pb2.Summary.Value(
        tag=tag,
        metadata=summary_pb2.SummaryMetadata(
            plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text")
        ),
        tensor=tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[utf8(text)]),
    )


def utf8(text: str) -> bytes:
    """``text`` as UTF-8; a lone surrogate (``"\\ud800"``, as bytes decoded with
    ``surrogateescape`` leave) becomes U+FFFD instead of costing the whole event."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        return _SURROGATES.sub("\ufffd", text).encode("utf-8")


def markdown_table(columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; ``|`` and line breaks inside cells are escaped so rows stay rows."""
    def cell(value: Any) -> str:
        text = value if isinstance(value, str) else _format_number(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\r\n", "\n").replace(
            "\n", "<br>"
        )

    header = "| " + " | ".join(cell(c) for c in columns) + " |"
    rule = "|" + "---|" * len(columns)
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join([header, rule, *body])


def _format_number(value: Any) -> str:
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)
