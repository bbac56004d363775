"""The redaction primitives live in `detdata.base.redact` (the base layer, so that every
`DetdataError` message passes through them); this name re-exports them for existing imports.
"""

from detdata.base.redact import (
    CLIENT_LOGGERS as CLIENT_LOGGERS,
)
from detdata.base.redact import (
    MASK as MASK,
)
from detdata.base.redact import (
    SECRET_PARAMS as SECRET_PARAMS,
)
from detdata.base.redact import (
    SECRET_WORDS as SECRET_WORDS,
)
from detdata.base.redact import (
    RedactingFilter as RedactingFilter,
)
from detdata.base.redact import (
    get_logger as get_logger,
)
from detdata.base.redact import (
    has_credentials as has_credentials,
)
from detdata.base.redact import (
    install_log_redaction as install_log_redaction,
)
from detdata.base.redact import (
    is_secret_param as is_secret_param,
)
from detdata.base.redact import (
    redact_text as redact_text,
)
from detdata.base.redact import (
    redact_url as redact_url,
)
from detdata.base.redact import (
    redact_value as redact_value,
)
from detdata.base.redact import (
    scrub_exception as scrub_exception,
)
from detdata.base.redact import (
    strip_credentials as strip_credentials,
)
