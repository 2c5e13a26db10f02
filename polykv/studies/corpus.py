"""The offline corpus of studies, re-exported from :mod:`polykv.models.corpus` (a bottom module, because
calibration draws its sequences from the same corpus)."""

from polykv.models.corpus import (  # noqa: F401
                                     CORPUS_RECIPE,
                                     KINDS,
                                     Document,
                                     corpus_id,
                                     corpus_documents,
                                     corpus_texts,
                                     corpus_fingerprint,
                                     filler_text,
                                     )
