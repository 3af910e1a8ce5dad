#!/bin/sh
echo "coverage is not available in this offline build (remote_coverage_tools is a stub)" >&2
exit 1
