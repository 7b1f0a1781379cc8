/**
 * The one mapping of error codes to HTTP statuses (docs/protocol.md section 10): the socket
 * protocol's codes, and the few the HTTP front adds for what only HTTP has (routes, methods,
 * the gate, offsets). Every error body is `{"error":{"code","message","requestId"}}`.
 */
import * as HttpServerResponse from "@effect/platform/HttpServerResponse"

export const STATUS: Readonly<Record<string, number>> = {
  // The socket protocol's codes.
  parse_error: 400,
  invalid_command: 400,
  unsupported_protocol: 400,
  unknown_command: 404,
  line_too_long: 413,
  session_not_found: 404,
  session_busy: 409,
  name_taken: 409,
  session_failed: 409,
  session_damaged: 409,
  telemetry_policy_violation: 403,
  storage_unavailable: 503,
  shutting_down: 503,
  internal: 500,
  // The HTTP front's own.
  not_found: 404,
  method_not_allowed: 405,
  unauthorized: 401,
  forbidden_origin: 403,
  misdirected_request: 421,
  invalid_offset: 400,
  offset_gone: 410,
  unsupported_media_type: 415
}

export const statusOf = (code: string): number => STATUS[code] ?? 500

export const REQUEST_ID_HEADER = "x-request-id"

/** An error answer; extra headers (Allow, Link) as given. */
export const errorResponse = (
  code: string,
  message: string,
  requestId: string,
  headers: Record<string, string> = {},
  status: number = statusOf(code)
) =>
  HttpServerResponse.text(JSON.stringify({ error: { code, message, requestId } }), {
    status,
    contentType: "application/json",
    headers: { ...headers, [REQUEST_ID_HEADER]: requestId, "cache-control": "no-store" }
  })
