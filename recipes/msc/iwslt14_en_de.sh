#!/usr/bin/env bash
# MSC on IWSLT14 en-de: see recipes/msc/iwslt.sh --help (same options, the direction is fixed).
exec bash "$(dirname "${BASH_SOURCE[0]}")/iwslt.sh" --direction en-de "$@"
