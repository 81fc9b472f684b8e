"""The parts of a gVisor box's network card that need no sandbox: what a save reads
to find the box's endpoints in TIME_WAIT, and how runsc's long refusals are cut."""

from __future__ import annotations

from sandlot.engine.gvisor import network, runsc

CONNTRACK = """\
ipv4     2 tcp      6 119 TIME_WAIT src=10.0.2.15 dst=10.0.2.2 sport=60545 dport=5555 src=10.0.2.2 dst=10.0.2.15 sport=5555 dport=60545 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 9 CLOSE src=10.0.2.15 dst=10.0.2.100 sport=31926 dport=80 src=10.0.2.100 dst=10.0.2.15 sport=80 dport=31926 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 431999 ESTABLISHED src=10.0.2.15 dst=10.0.2.100 sport=40000 dport=3128 src=10.0.2.100 dst=10.0.2.15 sport=3128 dport=40000 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 30 LAST_ACK src=10.0.2.2 dst=10.0.2.15 sport=41234 dport=8000 src=10.0.2.15 dst=10.0.2.2 sport=8000 dport=41234 [ASSURED] mark=0 zone=0 use=2
ipv4     2 tcp      6 100 TIME_WAIT src=10.0.2.15 dst=93.184.216.34 sport=40001 dport=443 src=10.0.2.2 dst=10.0.2.15 sport=1 dport=40001 [ASSURED] mark=0 zone=0 use=2
ipv4     2 udp      17 29 src=10.0.2.15 dst=10.0.2.3 sport=5353 dport=53 src=10.0.2.3 dst=10.0.2.15 sport=53 dport=5353 mark=0 zone=0 use=2
ipv4     2 tcp      6 100 TIME_WAIT src=10.9.9.9 dst=10.9.9.8 sport=1 dport=2 src=10.9.9.8 dst=10.9.9.9 sport=2 dport=1 mark=0 zone=0 use=2
"""  # noqa: E501  (the kernel's own lines)


def test_closed_flows_are_the_box_s_ended_tcp_connections_either_way() -> None:
    assert network.closed_flows(CONNTRACK) == {
        (60545, "10.0.2.2", 5555),  # the box connected out, and closed
        (31926, "10.0.2.100", 80),  # ended by a reset: probed all the same (a TIME_WAIT ignores one)
        (8000, "10.0.2.2", 41234),  # a connection to the box's published port
        (40001, "93.184.216.34", 443),  # open mode's: as the box sees it, not as redirected
    }
    assert network.closed_flows("") == set()


def test_host_time_waits_read_proc_net_tcp() -> None:
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0202000A:15B3 0F02000A:EC81 06 00000000:00000000 03:00001770 00000000     0        0 0\n"
        "   1: 6402000A:0050 0F02000A:7CBE 01 00000000:00000000 00:00000000 00000000     0        0 1\n"
        "   2: 0100007F:0050 0100007F:7CBE 06 00000000:00000000 03:00001770 00000000     0        0 0\n"
    )
    assert network.host_time_waits(text) == {(0xEC81, "10.0.2.2", 5555)}


def test_a_bare_ack_is_a_well_formed_tcp_segment() -> None:
    packet = network.bare_ack("10.0.2.2", 5555, "10.0.2.15", 60545)
    assert len(packet) == 40 and packet[0] == 0x45 and packet[9] == 6
    tcp = packet[20:]
    assert int.from_bytes(tcp[0:2], "big") == 5555 and int.from_bytes(tcp[2:4], "big") == 60545
    assert tcp[13] == 0x10  # ACK alone
    pseudo = packet[12:20] + bytes([0, 6]) + len(tcp).to_bytes(2, "big")
    assert network.internet_checksum(pseudo + tcp) == 0  # a checksum over a segment with its own is zero


def test_runsc_reasons_are_cut_to_what_says_why() -> None:
    dump = "checkpoint failed: encoding error at object tcp.endpoint{" + "x" * 20000
    dump += "}: save rejected due to unsupported networking state: endpoint cannot be saved\npanic(...)"
    short = runsc.reason(dump)
    assert short.startswith("… save rejected due to unsupported networking state") and len(short) < 700
    assert runsc.reason("  plain  ") == "plain"
