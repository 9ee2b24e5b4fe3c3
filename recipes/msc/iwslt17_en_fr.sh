#!/usr/bin/env bash
# MSC on IWSLT17 en-fr: see recipes/msc/iwslt.sh --help (same options, the direction is fixed).
exec bash "$(dirname "${BASH_SOURCE[0]}")/iwslt.sh" --direction en-fr "$@"
