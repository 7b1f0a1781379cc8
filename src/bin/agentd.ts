#!/usr/bin/env node
/**
 * `node dist/src/bin/agentd.js ...`: the same command as the package's bin, agentd.cjs (see
 * there), for whoever runs the file by this name.
 */
import { createRequire } from "node:module"

createRequire(import.meta.url)("./agentd.cjs")
